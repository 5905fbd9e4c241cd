"""laneway's per-node worker service and the per-attempt supervisor."""
