"""Pretrained checkpoints: an earlier import path, kept as a plain re-export of ``ppo_objectives.train.pretrained``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.train.pretrained import (
    ARCHITECTURES,
    SHIPPED_GGUF,
    TOKEN_MAPS,
    TokenMappedLM,
    export_hf_checkpoint,
    load_causal_lm,
    load_policy_model,
    load_tokenizer,
    main,
    shipped_gguf_path,
    task_token_ids,
    write_tiny_checkpoint,
)

__all__ = ["ARCHITECTURES", "SHIPPED_GGUF", "TOKEN_MAPS", "TokenMappedLM", "export_hf_checkpoint", "load_causal_lm", "load_policy_model", "load_tokenizer", "main", "shipped_gguf_path", "task_token_ids", "write_tiny_checkpoint"]  # fmt: skip

if __name__ == "__main__":
    import sys

    sys.exit(main())
