"""What a run writes and reads back: safe file writes, run directories, checkpoints, run files."""
