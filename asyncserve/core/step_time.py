"""Step time per token, measured, and the prefill tokens a step may take while streams decode.

A step that prefills a long chunk makes every running stream wait for it: on a slow device a
chunk of max_num_batched_tokens can take seconds. StepTimeModel fits the measured step times
to t = overhead + per_token * tokens (exponentially weighted least squares, so it follows the
device as contexts grow), and prefill_budget() gives the prefill tokens that keep a step with
the running decodes under the target. It never goes below one block's worth of tokens, so a
prompt always makes progress, and it is only a cap: max_num_batched_tokens stays the ceiling.

A sample far above the fit (a kernel compiling, the machine busy for a moment) is set aside
unless it repeats, so one hiccup does not shrink the budget for the steps after it. The fit
is trusted at most twice beyond the largest step measured: after a run of one-token decode
steps the per-token cost is barely known, so a long prompt starts with small chunks that
double while they stay under the target, and never one huge step on a guess.
"""

from __future__ import annotations

# Weight kept by the older samples at each new one: about the last 10 steps count.
_DECAY = 0.9
# How far past the largest measured step the fit is trusted.
_MAX_GROWTH = 2
# A sample this many times slower than predicted is an outlier, until it happens this often
# in a row.
_OUTLIER_RATIO = 4.0
_OUTLIER_RUN = 3


class StepTimeModel:
    def __init__(self, decay: float = _DECAY) -> None:
        self.decay = decay
        # Exponentially weighted sums over samples (n tokens, t seconds).
        self._w = 0.0
        self._n = 0.0
        self._t = 0.0
        self._nn = 0.0
        self._nt = 0.0
        self._outliers = 0
        self.num_samples = 0
        self.largest_step = 0  # tokens of the largest step measured

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step: how many tokens it computed and how long it took."""
        if num_tokens < 1 or seconds <= 0:
            return
        self.largest_step = max(self.largest_step, num_tokens)
        predicted = self.predict(num_tokens)
        if predicted is not None and seconds > _OUTLIER_RATIO * predicted:
            self._outliers += 1
            if self._outliers < _OUTLIER_RUN:
                return
        self._outliers = 0
        d = self.decay
        n, t = float(num_tokens), seconds
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + t
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * t
        self.num_samples += 1

    def fit(self) -> tuple[float, float] | None:
        """(overhead seconds per step, seconds per token), or None before any sample.

        While every sample had about the same size (only decodes so far) the two cannot be
        told apart: the whole time is charged to the tokens, which errs on the safe side."""
        if self.num_samples == 0:
            return None
        mean_n = self._n / self._w
        mean_t = self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n <= 1e-9 * max(mean_n * mean_n, 1.0):
            return 0.0, mean_t / mean_n
        per_token = (self._nt / self._w - mean_n * mean_t) / var_n
        if per_token <= 0:  # noise: bigger steps were not slower
            return 0.0, mean_t / mean_n
        overhead = max(mean_t - per_token * mean_n, 0.0)
        return overhead, per_token

    def predict(self, num_tokens: int) -> float | None:
        fit = self.fit()
        if fit is None:
            return None
        overhead, per_token = fit
        return overhead + per_token * num_tokens

    def prefill_budget(self, num_decodes: int, target_s: float, min_tokens: int) -> int | None:
        """Prefill tokens a step with `num_decodes` decodes may add and stay within
        target_s; at least min_tokens. None: no measurement yet, no cap."""
        fit = self.fit()
        if fit is None:
            return None
        overhead, per_token = fit
        fits = (target_s - overhead) / per_token - num_decodes
        known = _MAX_GROWTH * self.largest_step - num_decodes
        return max(int(min(fits, known)), min_tokens)
