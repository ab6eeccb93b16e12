"""LoRA adapters: many fine-tunes served on one base model, mixed in one batch."""
