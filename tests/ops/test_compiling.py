"""torch.compile as the models use it: inductor's widened persistent-reduction choice, installed once."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config

from encoder_service.ops import compiled, compiling, linear_activation


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(config, "inductor_choices_class", None)
    monkeypatch.setattr(compiling, "_installed", None)


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
