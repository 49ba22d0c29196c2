"""Whether a restore pays: measured prefill speed against measured restore speed, never a
constant."""

from __future__ import annotations

from ferrum.engine.kv.tiers.entries import Saved, Tier


class Costs:
    """Measured speeds: prefill tokens/s from engine steps, restore bytes/s per tier."""

    _WEIGHT = 0.3  # of each new measurement in the running average

    def __init__(self) -> None:
        self.prefill_tps: float | None = None
        self.restore_bps: dict[Tier, float] = {}

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= 32 and seconds > 0:
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)

    def restored(self, tier: Tier, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.restore_bps[tier] = self._mix(self.restore_bps.get(tier), nbytes / seconds)

    def worth(self, entry: Saved, tokens_saved: int) -> bool:
        """Whether restoring `entry` costs less than computing `tokens_saved` positions."""
        bps = self.restore_bps.get(entry.tier)
        if self.prefill_tps is None or bps is None:
            return True
        if entry.tier is Tier.DISK and Tier.RAM in self.restore_bps:
            # From disk: read into RAM, then the RAM restore.
            bps = 1 / (1 / bps + 1 / self.restore_bps[Tier.RAM])
        return entry.state_bytes / bps < tokens_saved / self.prefill_tps

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._WEIGHT * (new - old)
