"""Adapters applied to a built model from outside, the base frozen: LoRA (:mod:`.lora`) and its PEFT format
(:mod:`.peft`)."""

from .lora import DEFAULT_TARGETS, LoRALinear, LoRASettings, apply_lora, is_adapter, merge_lora

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "LoRASettings", "apply_lora", "is_adapter", "merge_lora"]
