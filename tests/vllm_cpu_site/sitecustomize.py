"""Loaded by every Python process of tests/integrations/vllm/test_vllm_engine.py's vLLM runs (this folder is first on
their PYTHONPATH), engine, registry-inspection and build subprocesses alike; never by the test
suite itself.

Why: the registry's torchvision (0.28.0, the one built for torch 2.13) is a CUDA build. Its C++
ops library ``torchvision/_C.so`` links libtorch_cuda.so, which the CPU torch has not, so it does
not load; torchvision then imports without its ops, except that ``torchvision/_meta_registrations.py``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, and that
fails with "operator torchvision::nms does not exist": ``import torchvision`` raises. transformers
needs torchvision for Qwen2.5-VL: its default ``Qwen2VLImageProcessor`` (the torchvision backend,
the one vLLM's processor uses and the encoder's ``--preprocess torch`` matches) and the
``Qwen2VLVideoProcessor`` that ``Qwen2_5_VLProcessor`` always loads. Declaring the two operators'
schemas here (no kernels) lets torchvision import; the transforms used (resize, normalize on
tensors) are plain torch and never call the C++ ops, and nothing here calls nms.
"""

import torch.library

_TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")  # kept alive: the schemas live as long as it
_TORCHVISION_SCHEMAS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TORCHVISION_SCHEMAS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
