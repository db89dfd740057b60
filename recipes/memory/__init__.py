"""The memory planner: `longstride plan` and the traced step it runs."""
