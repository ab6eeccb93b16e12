"""The engine process's core: requests, the scheduler, KV block accounting, grammar matchers,
and the StepPlan / StepResult contract with the workers."""
