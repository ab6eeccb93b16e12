"""The engine process: AsyncEngine (requests in, outputs out) and the step loop that drives
the core (scheduler) and the executor (workers) one step after another."""
