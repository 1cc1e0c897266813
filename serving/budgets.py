"""Budget reservations: what a request may cost at most, reserved at admission against every
budget in its chain (tenant, project, key, end user), settled down to what it cost.

The reservation rule (docs/adr/0022-budgets-reserve-then-settle.md): a request reserves
``prompt x input price + n x max_tokens x output price`` (money) or ``prompt + n x max_tokens``
(tokens), at the price in effect when it is admitted, in the same ``admit.lua`` call that
charges its token buckets; a budget that cannot hold the reservation refuses the request (429
``insufficient_quota``), and nothing is charged anywhere. Settlement (``settle.lua`` then
``release.lua``) gives back the reservation minus the exact cost (cached-token pricing
included), once.

Every amount is an integer so Lua adds and compares exactly: money in micro-units of the
budget's currency (``tenants.budgets.MICRO``), prices in pico-units per token (a price per
million tokens has at most 6 decimals, so ``price x 10^6`` is whole). A request's cost is
rounded *up* to the micro-unit, so a counter never holds less than the exact spend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from tenants.budgets import MICRO, BudgetRule, Window, counter_key, from_units, window

PICO_PER_MICRO = 1_000_000
# A counter outlives its period by this much, so a request admitted just before the boundary
# (charged to the period that admitted it) still finds its counter when it settles.
COUNTER_GRACE_S = 2 * 86_400
LEVEL_NAMES = {"tenant": "tenant", "project": "project", "key": "API key",
               "end_user": "end user"}


@dataclass(frozen=True)
class UnitPrices:
    """A model's price fixed at admission: pico-units of ``currency`` per token."""

    currency: str
    input: int
    cached: int
    output: int

    @classmethod
    def per_mtok(cls, currency: str, inp: Decimal, cached: Decimal, out: Decimal) -> UnitPrices:
        def pico(per_million: Decimal) -> int:
            return int(Decimal(per_million) * PICO_PER_MICRO)
        return cls(currency, pico(inp), pico(cached), pico(out))

    def micro_cost(self, prompt: int, cached: int, output: int) -> int:
        """Exact cost, rounded up to the micro-unit; ``prompt`` includes ``cached`` (OpenAI)."""
        cached = min(cached, prompt)
        pico = (prompt - cached) * self.input + cached * self.cached + output * self.output
        return -(-pico // PICO_PER_MICRO)


@dataclass(frozen=True)
class Charge:
    """One budget's share of a reservation: its counter, limit and the amount reserved."""

    rule: BudgetRule
    key: str
    amount: int
    window: Window
    reset_s: int  # seconds until the period ends; 0 for a lifetime budget
    ttl_s: int  # the counter's expiry; 0 = none (lifetime)


@dataclass(frozen=True)
class Reservation:
    charges: tuple[Charge, ...]
    prices: UnitPrices | None

    def admit_args(self) -> list[int]:
        """admit.lua's ARGV tail: the count, then (limit, amount, ttl) per budget."""
        out = [len(self.charges)]
        for c in self.charges:
            out += [c.rule.limit, c.amount, c.ttl_s]
        return out

    def req_fields(self) -> dict[str, str | int]:
        """What settlement needs, kept in the request's hash: keys, metrics, amounts, prices."""
        if not self.charges:
            return {}
        p = self.prices
        return {"bk": " ".join(c.key for c in self.charges),
                "bm": " ".join(c.rule.metric for c in self.charges),
                "bv": " ".join(str(c.amount) for c in self.charges),
                "pi": p.input if p else 0, "pc": p.cached if p else 0, "po": p.output if p else 0}


NONE = Reservation((), None)


def reserve(tenant_id: object, rules: Sequence[BudgetRule], prices: UnitPrices | None,
            prompt: int, max_output: int, now: float) -> Reservation:
    """The reservation of one request against ``rules``.

    A money budget counts usage priced in its own currency only: a model without a price (or
    priced in another currency) reserves nothing against it (token budgets still count it).
    """
    when = datetime.fromtimestamp(now, UTC)
    charges = []
    for rule in rules:
        if rule.money:
            if prices is None or prices.currency != rule.currency:
                continue
            amount = prices.micro_cost(prompt, 0, max_output)
        else:
            amount = prompt + max_output
        span = window(rule.period, when)
        reset = max(1, int((span.end - when).total_seconds()) + 1) if span.end else 0
        charges.append(Charge(rule, counter_key(tenant_id, rule, span.label), amount, span,
                              reset, reset + COUNTER_GRACE_S if reset else 0))
    return Reservation(tuple(charges), prices)


def settled_amounts(metrics: Sequence[str], prices: UnitPrices, prompt: int, cached: int,
                    output: int) -> list[int]:
    """What a settled request cost each budget: the exact cost, or its tokens."""
    cost = prices.micro_cost(prompt, cached, output)
    return [cost if m == "money" else prompt + output for m in metrics]


def refusal_message(charge: Charge, used: int) -> str:
    """The 429 insufficient_quota text: which level, how much is left, when it resets."""
    rule = charge.rule
    name = LEVEL_NAMES.get(rule.level, rule.level)

    def amount(units: int) -> str:
        value = from_units(max(units, 0), rule.metric)
        return f"{value:,.6f}".rstrip("0").rstrip(".") + f" {rule.currency}" if rule.money \
            else f"{value:,.0f} tokens"

    left = amount(rule.limit - used)
    period = "lifetime" if rule.period == "lifetime" else f"per {rule.period} (UTC)"
    resets = (f"It resets at {charge.window.end:%Y-%m-%d %H:%M} UTC."
              if charge.window.end else "It does not reset; an owner can raise it.")
    return (f"Budget exceeded: the {name} budget of {amount(rule.limit)} {period} has {left} "
            f"left, and this request reserves up to {amount(charge.amount)} (its prompt plus "
            f"n x max_tokens at the output price). {resets}")


__all__ = [
    "MICRO",
    "NONE",
    "BudgetRule",
    "Charge",
    "Reservation",
    "UnitPrices",
    "refusal_message",
    "reserve",
    "settled_amounts",
]
