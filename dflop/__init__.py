"""dflop: data-aware planning, scheduling and simulation for multimodal LLM training."""
