"""Runtime support: scale settings (LoRA, vLLM, DeepSpeed), CPU multi-process launches, noise filters."""
