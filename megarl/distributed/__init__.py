"""Process groups: the parallel layout (TP, PP, DP, EP, CP) and torch.distributed's set-up and shut-down."""
