"""Order statistics of the timing samples, computed as bench/stats.cpp computes them."""


def quantile(sorted_s, f):
    """Linear interpolation between order statistics (numpy's default), as bench/stats.cpp."""
    pos = f * (len(sorted_s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_s) - 1)
    return sorted_s[lo] + (sorted_s[hi] - sorted_s[lo]) * (pos - lo)


def summarize(samples):
    s = sorted(samples)
    if not s:
        return None
    return dict(count=len(s), min=s[0], p25=quantile(s, 0.25), median=quantile(s, 0.5), p75=quantile(s, 0.75),
                max=s[-1])


def scaled_summary(summary, k):
    return {key: (v * k if key != "count" else v) for key, v in summary.items()}
