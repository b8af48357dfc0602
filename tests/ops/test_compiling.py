"""torch.compile as the models use it: inductor's widened persistent-reduction choice, installed once."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config

from encoder_service.ops import compiled, compiling, linear_activation


@pytest.fixture
def fresh_choices(monkeypatch):
    # config.patch, not monkeypatch: inductor's config module loses an entry that monkeypatch restores.
    monkeypatch.setattr(compiling, "_installed", None)
    with config.patch(inductor_choices_class=None):
        yield


def test_compiling_installs_the_wide_row_choices_once(fresh_choices):
    fn = compiled(lambda x: x + 1)
    assert config.inductor_choices_class is compiling._wide_row_choices
    choices = config.inductor_choices_class()
    assert str(compiling.PERSISTENT_ROW_LIMIT) in choices.uuid()
    assert callable(fn)  # torch.compile is lazy: nothing compiled on this host
    assert compiling.install_inductor_choices() is True


def test_choices_someone_else_set_are_left_alone(fresh_choices):
    from torch._inductor.choices import InductorChoices

    def theirs():
        return InductorChoices()

    config.inductor_choices_class = theirs
    assert compiling.install_inductor_choices() is False
    assert config.inductor_choices_class is theirs


def test_the_cpu_keeps_the_references_linear_then_activation():
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 16), torch.randn(24, 16), torch.randn(24)
    for act in ("gelu_pytorch_tanh", "gelu", "silu"):
        ref = {"gelu_pytorch_tanh": lambda y: F.gelu(y, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}[act]
        assert torch.equal(linear_activation(x, w, b, act), ref(F.linear(x, w, b)))


class _Features:
    """What inductor's heuristic reads of a reduction kernel: its row length and its hint."""

    numel = 1 << 20

    def __init__(self, reduction_numel: int) -> None:
        from torch._inductor.runtime.hints import ReductionHint

        self.reduction_numel = reduction_numel
        self.hint = ReductionHint.INNER

    def get_reduction_hint(self):
        return self.hint


class _Graph:
    class sizevars:  # inductor reads V.graph.sizevars
        @staticmethod
        def statically_known_leq(a, b):
            return a <= b

        @staticmethod
        def optimization_hint(x):
            return x


def test_rows_of_the_towers_hidden_sizes_are_kept_in_registers_up_to_the_limit():
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    ours = compiling._wide_row_choices()
    with V.set_graph_handler(_Graph()):
        for width in (1152, 1280):  # Qwen3-VL / Kimi-K2.5, Qwen2.5-VL: inductor alone loops over them
            assert not InductorChoices.should_use_persistent_reduction(_Features(width), False)
            assert ours.should_use_persistent_reduction(_Features(width), False)
        assert ours.should_use_persistent_reduction(_Features(compiling.PERSISTENT_ROW_LIMIT), False)
        assert not ours.should_use_persistent_reduction(_Features(2 * compiling.PERSISTENT_ROW_LIMIT), False)
        assert ours.should_use_persistent_reduction(_Features(512), False)  # inductor's own answer stays
        # A cooperative reduction (rows split over programs) keeps inductor's answer.
        cooperative = InductorChoices.should_use_persistent_reduction(_Features(1152), True)
        assert ours.should_use_persistent_reduction(_Features(1152), True) == cooperative
