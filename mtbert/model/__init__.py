"""The backbone, the per-task encoder architectures, pooling, heads, the multitask model and saved model folders."""
