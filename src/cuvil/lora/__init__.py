"""LoRA adapters: reading and mapping them (issue 23), merged at compile time or hot-swapped through slots."""
