"""What a prefill costs, learnt from the prefills so far: a cost per call plus a cost per token.

The decode scheduler cuts requests that arrive together into prefill groups so that the first
of them need not wait for the prefill of all the others. Whether that pays depends on how a
prefill's time grows with its tokens. On a GPU, or with a tiny model, a prefill costs mostly
per call (kernel launches, Python), and one prefill of eight prompts takes little longer than
one of a single prompt: splitting only adds calls. On a CPU with a model of some size it costs
mostly per token, and one prefill of eight makes the first wait for the other seven.

A single figure per token, the time of each prefill divided by its tokens, mixes the two: a
large model on a GPU (30 ms a call, whatever the prompt) looks like 0.3 ms per token for
100-token prompts, and a burst of eight would be prefilled one prompt at a time, eight calls
instead of one. So the cost is fitted as `per_call + per_token * tokens`, by least squares over
the recent prefills (each weighs `decay` times the one after it).

Until prefills of different sizes have been seen the two parts cannot be told apart, and the
scheduler makes one prefill of all that arrived together (as it does before the first prefill):
that prefill is itself of another size than the ones before it, and the fit learns from it.
"""

from __future__ import annotations


class PrefillCost:
    def __init__(self, decay: float = 0.9):
        self.decay = decay
        # Decayed sums of the weights, tokens, seconds, tokens^2 and tokens*seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        d, x = self.decay, float(max(1, tokens))
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds

    def fit(self) -> tuple[float, float] | None:
        """(seconds per call, seconds per token); None until prefills of sizes a few percent
        apart have been seen (before that a slope means nothing)."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= (0.05 * mx) ** 2:
            return None
        per_token = (self._xy / self._w - mx * my) / var
        if per_token <= 0:  # bigger prefills were no slower: all of it is per call
            return my, 0.0
        per_call = my - per_token * mx
        if per_call < 0:  # noise, or no cost per call to speak of: all of it per token
            return 0.0, my / mx
        return per_call, per_token
