"""Errors a user can fix: the command line prints them as one line and exits with code 2."""


class UsageError(Exception):
    """A problem the user can fix (bad option values, missing files); printed as one line."""


class TrainingStopped(Exception):
    """A run the stability guard stopped (too many bad steps in a row) inside a command that needs it finished (an
    experiment, the quickstart): the command line prints the one line and exits with code 2. ``name``: the run (an
    arm), ``step``: the step it stopped at, ``last_good``: its last good step, ``checkpoint``: where that step is
    saved (``None``: no good step to save)."""

    def __init__(self, name: str, out: str, step: int, last_good: int, checkpoint: str | None, reason: str):
        self.name, self.out, self.step, self.last_good, self.checkpoint = name, out, step, last_good, checkpoint
        self.reason = reason
        resume = (f"its last good step, {last_good}, is saved in {checkpoint}: the same command resumes from there"
                  if checkpoint else "it had no good step to save")
        super().__init__(f"{name} ({out}): the stability guard stopped training at step {step} ({reason}); {resume} "
                         "(finished runs are kept and reused; a lower --lr may train through)")

    def __reduce__(self):  # rebuilt from its fields (a run stopped in a worker process reaches the parent whole)
        return type(self), (self.name, self.out, self.step, self.last_good, self.checkpoint, self.reason)
