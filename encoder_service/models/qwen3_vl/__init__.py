"""Qwen3-VL / Qwen3.5 vision tower (``model_type`` qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe).

One tower serves the four: the MoE variants differ only in their LLM, and Qwen3.5 is Qwen3-VL's
tower without the deepstack mergers. ``loading.load`` is the registry entry point.
"""
