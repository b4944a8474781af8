"""The actor's errors that name their fix (the CLI prints them as one line, exit 2)."""


class SkippedStepsError(RuntimeError):
    """More optimizer steps skipped for non-finite gradients than `actor.max_skipped_steps` allows.

    The skip decision is agreed over the world group, so every rank raises it at the same step.
    """
