"""Cost-aware speculation: how much each row drafts, chosen from what the hardware charges.

A row's draft has a depth g and a breadth k (children per expanded node: 1 is a chain, more an EAGLE-2
tree). A step of B rows costs a target forward over M = sum(1 + n_b) tokens (n_b: the nodes the row's draft
holds: g for a chain, the tree's size for a tree) plus each row's drafting, and yields sum E_b tokens, where a
row whose drafts pass depth j with probability a_j(k) (its own running acceptance at that breadth) expects

    E(g, k) = 1 + a_1(k) + a_1(k) a_2(k) + ... + a_1(k) ... a_g(k)   (the target's token, then accepted drafts).

The planner picks every row's (g, k) to maximise tokens per second, sum E_b / (T(M) + S(B) + sum D_b(g_b, k_b)),
with T, S (what a step of B rows that drafts nothing spends outside the forward: sampling, bookkeeping) and D
from a ``Profile`` of measured times; g = 0 (propose nothing) is always a candidate, so a row for
which speculation does not pay runs as autoregressive decoding: a default job is never slower than AR
by the profile's own measure, but for rows too new to tell: a row stops drafting only where drafting loses
with its acceptances raised by ``DOUBT`` standard errors (a stopped row measures nothing, so a low estimate
would otherwise never be put right). The breadth matters where a wide forward is dear: a 4-wide tree of depth 1 is
5 tokens to verify, a chain of depth 1 two. The choice is a pure function of the profile and the rows'
statistics.

A one-row pass's cost T is kept per band of contexts (``context_band``): every query of a pass attends over the
whole context, so a wide pass costs more beside a long one (2,000 positions into a chat, a 2-token pass of the
embedded 4-bit target cost 1.53x a 1-token one, against 1.06x after 128). With one curve for all, a long chat's
costs priced a short answer's drafts out, and a short answer's priced a long chat's in.

The profile is measured by the engine as it runs and can be measured ahead (``fuzzyspec tune``). A draft's
cost D is all that a step which drafts spends beyond its forward and beyond S: the proposal, and the judging,
masks and bookkeeping a draft brings (the engine times whole steps: pricing the proposal alone left a 1-token
chain about 30% cheaper than it was, on a 4-bit target).
``tuning`` keeps the profile per target, weights, dtype, device, thread count and compilation. A width never
measured is assumed to cost what the nearest measured narrower width costs, or, wider than every one measured, what
the line toward a wider prompt pass of this process gives (``Profile.observe_prompt``): optimism either way, so it
gets tried, and after a few measurements their minimum decides. A draft size below every measured one is assumed to
cost its share of the smallest measured (drafting nothing costs nothing), and acceptances start from a prior worth
about ten of a row's own steps: the acceptance the drafter's earlier rows met under the same rule
(``Profile.population``, kept with the profile), or ``PRIOR_ACCEPTANCE`` before any; a row's counts fade slowly every
step, so one that stopped drafting comes back to the prior.

A draft copied from the text (``drafters.lookup.CopyFirst``) is not planned: it is proposed wherever the text
repeats itself. Only its length is chosen here (``copy_length``), by the same arithmetic with no drafting cost, from
the copies' own acceptance (kept under ``COPY``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .config import tree_nodes

PRIOR_ACCEPTANCE = 0.6  # a_j(1) before a row has data (the shipped EAGLE chain's first draft averaged 0.51; with
# PRIOR_WIDER's widening, 0.6 gives trees 2, 4 and 8 wide the 0.66, 0.75 and 0.87 those drafts reached. A prior of
# 0.5 ran 1.06x AR against 0.6's 1.03 in one run, but in another, where a 2-token step had been measured dear, it
# left 54% of steps to AR: 1.01x against 1.02)
PRIOR_WIDER = 0.15      # the share of a chain's misses each further child per node is assumed to catch
# Within an answer a draft's acceptance is close to independent from step to step (the shipped EAGLE chain's
# first draft, 16 everyday answers: lag-1 correlation 0.04 about each answer's own rate), while answers differ
# (rates 0.35-0.78 around 0.51). So a row's estimate is its answer's long average, and the prior weighs what a
# spread of about 0.11 between answers is worth: about ten steps. With a prior worth two steps and counts fading
# by 0.95, an estimate swung by chance under break-even often enough to send 31-58% of a compiled int4 target's
# steps to AR, where drafting paid: in three interleaved runs of 24-32 everyday prompts the default job ran
# 1.00-1.04x AR that way and 1.02-1.05x with these values (2-7% of steps AR); eager, and float32 compiled
# (where drafting hardly pays), the same as before within a run's noise (benchmarks/results_planner_ab_epyc.txt).
PRIOR_WEIGHT = 10.0     # in steps: how soon a row's own data outweighs the prior
MEMORY = 0.99           # a row's counts fade by this per step, so a long answer's estimate follows its text
# A row stops drafting only where drafting loses even with its acceptances raised by DOUBT standard errors (``plan``).
# A stopped row measures nothing, so an estimate swung low by a few early misses stayed low: in one run over the 64
# everyday prompts (compiled int4; benchmarks/results_plan_log_epyc_2026-11-27.txt), rows whose first four drafts all
# failed drafted nothing in 24 of their next 28 plans, 31 of 32, where break-even had risen near the prior, and the
# job sent 49% of its steps to AR (1.089x AR against a fixed 1-token chain's 1.125x). Near break-even a draft costs
# little whichever way it goes, so trying on costs little. In eight paired runs (O63-O70 in
# benchmarks/results_planner_ab_epyc.txt) it cut the steps at AR from 2-21% to 1-3%: the same speed natively
# (0.989-1.010x), 0.997-1.036x on the AVX2 class (emulated).
DOUBT = 1.0
POPULATION_MEMORY = 0.999  # a drafter's acceptance over all rows (a new row's prior) fades this much a step
TRIALS = 3              # measurements of a new size before the planner trusts its cost
STRIDE = 0.02           # how far one measurement moves a cost's running median, as a share of it
# How a settled target pass of t ms moves the machine's pace P and its size's cost c (``Profile``): by
# r = log(t / (P c)), clamped to +-PACE_CLAMP, P by the share PACE_SHARE of it and c by the rest (so c by
# STRIDE at most, as the other costs' running medians move)
PACE_SHARE = 0.9
PACE_CLAMP = STRIDE / (1 - PACE_SHARE)
TARGET = ""             # the target's key among the drafters' (whose keys name a drafter and shape)
OUTSIDE = "+"           # the key of what steps spend outside the forward
COPY = "copy"           # the drafter name copies' acceptance is kept under (``copy_length``)
SHORT = 512             # contexts (positions) whose one-row passes are priced from ``Profile.target``


def context_band(context: int) -> int:
    """The band of contexts whose one-row passes share their costs: 0 for up to ``SHORT`` positions, else the power of
    two at or above ``context`` (1,024, 2,048, ...), as the engine's cache doubles."""
    return 0 if context <= SHORT else 1 << (context - 1).bit_length()


@dataclass
class Profile:
    """Measured milliseconds: ``target[w]`` a forward of one row of w tokens after at most ``SHORT`` positions,
    ``longer[band][w]`` the same after a context in ``band`` (``context_band``), ``batches[r][w]`` one of r rows
    (2 or more) of w tokens each, ``outside[r]`` what a step of r rows that drafts nothing spends outside its
    forward, ``draft[key][g]`` what drafting size g adds to a step (``key`` names the drafter and its shape:
    chain, or tree and breadth). Rows are kept apart because r rows of w tokens need not cost what
    one row of r x w does (each row attends to its own cache): with them filed together, a saved profile held
    13.9 ms for one row's 4-token step, which decoding alone measured at 7.6.

    A size's first ``TRIALS`` measurements are tentative: the planner does not see them (the size stays
    untried to it, so it is tried again) and the size's cost is their minimum, since a shared machine's noise
    only adds time. One slow first measurement had priced a size out for good: the planner re-measures only
    what it runs. So a price errs low on purpose: a size priced low is run, and measured again; one priced high is
    never run again. (Their median, tried on 2026-11-26, ran alike in an A/B, 1.134x against 1.135x AR, and was
    not kept for that asymmetry.) Sizes given at construction or loaded are taken as measured.

    A shared machine's speed drifts: within one run a 1-token step's median went from 5.9 to 9.3 ms and back over a
    few hundred steps. Each size's cost moves only when that size runs, so sizes measured in a slow stretch looked
    dear beside sizes last measured in a fast one: a profile held 11.6 ms for a 1-token pass and 11.6 for a 2-token
    one, whose steps cost 7.4 and more, so the planner drafted wherever it could, and lost where drafts fail. So
    costs are kept in the units of the machine's ``pace``: a target pass of a settled size moves the pace most of
    the way its time says and the size's cost the rest (``PACE_SHARE``); drafting and outside costs are filed
    over the pace. A drift moves the pace, and with it every cost alike; what sets one size apart from another
    stays in the sizes. Costs are read (and saved) as the pace times them: milliseconds now. In a simulation of
    such drift and spikes (``benchmarks/sim_profile_drift.py``: three widths run in phases of 30-200 passes), the
    estimated ratio of two widths' costs erred by 4-10% on average, against 16-18% with each size's own running
    median."""

    target: dict[int, float] = field(default_factory=dict)
    draft: dict[str, dict[int, float]] = field(default_factory=dict)
    batches: dict[int, dict[int, float]] = field(default_factory=dict)
    outside: dict[int, float] = field(default_factory=dict)  # rows -> ms; see above
    populations: dict[str, "Acceptance"] = field(default_factory=dict)  # see ``population``
    updates: int = 0  # measurements folded in since the profile was loaded
    trials: dict[tuple[str, int], int] = field(default_factory=dict)  # tentative sizes: measurements so far
    pace: float = 1.0  # how slow the machine runs now, against the costs held (see above)
    longer: dict[int, dict[int, float]] = field(default_factory=dict)  # band -> width -> ms, one row, past SHORT
    plans: int = 0  # plans made with it in this process (``engine.REFRESH``)
    prompts: dict[int, float] = field(default_factory=dict)  # one row's prompt passes by width (``observe_prompt``)

    def target_ms(self, width: int, rows: int = 1, context: int = 0) -> float:
        """A forward of ``rows`` rows of ``width`` tokens; one row's after ``context`` positions. A row count not yet
        measured, or a width narrower than every one measured for it, is guessed at what one row of rows x width
        tokens costs (until its own steps are measured). No width costs more than a wider one measured: a pass over
        fewer tokens does no more work, so where one was measured dearer, it met noise (a 2-token compiled step
        measured once at 7.2 ms beside a 4-token one's 6.4 priced 1-token chains out, and only what the planner runs
        is measured again)."""
        measured = self._settled(_batch_key(rows), self.batches.get(rows, {})) if rows > 1 else {}
        if not measured or width < min(measured):  # (a narrower width as well: see ``_one_row`` for why)
            measured, width = self._one_row(context), width * rows
        guide = measured
        if measured and width > max(measured):  # (see ``observe_prompt``)
            guide = measured | {wider: ms for wider, ms in self.prompts.items() if wider > max(measured)}
        return self.pace * min([_lookup(guide, width)] + [ms for wider, ms in measured.items() if wider > width])

    def _one_row(self, context: int) -> dict[int, float]:
        """The settled costs of one row's passes after ``context`` positions: its band's, and for widths narrower
        than every one its band has settled, the nearest shorter band's that has them, else the short contexts'
        (optimism, as for an untried width: a pass beside a shorter context costs no more, so a width priced that way
        is run, and measured). A band no pass has settled yet is thus priced as the nearest shorter one.

        Why the narrower widths: priced at the band's narrowest settled width (``_lookup``'s rule for a size below
        every measured one), a band whose first passes verified drafts priced a 1-token pass as dear as a 4-token
        one, so its rows drafted at every step, and a 1-token pass there was never run, so never measured: after
        ~2,300 positions of chat the default job decoded at 0.49-0.86x AR, drafting at every step."""
        band = context_band(context)
        costs = self._settled(TARGET, self.target)
        for shorter in sorted(b for b in self.longer if b <= band):
            settled = self._settled(_band_key(shorter), self.longer[shorter])
            if settled:
                costs = {width: ms for width, ms in costs.items() if width < min(settled)} | settled
        return costs

    def draft_ms(self, key: str, size: int) -> float:
        return _lookup(self.draft_costs(key), size) if size else 0.0

    def draft_costs(self, key: str) -> dict[int, float]:
        """The settled sizes of ``key``'s drafting and their costs, for ``_lookup``. Drafting nothing costs nothing:
        a size below every measured one is interpolated from zero, not taken at the smallest measured size's cost
        (once the cap was measured dear, every smaller size looked as dear and was never tried)."""
        return {0: 0.0} | {size: self.pace * ms for size, ms in self._settled(key, self.draft.get(key, {})).items()}

    def population(self, key: str) -> "Acceptance":
        """The acceptance of every row drafted for under ``key`` (a drafter and the rule judging it, see
        ``population_key``), which a new row starts from: counts that fade by ``POPULATION_MEMORY`` a step, so
        about the last thousand steps count. Kept with the profile, so a process's first answer starts from
        what earlier answers drafted, not from ``PRIOR_ACCEPTANCE``."""
        if key not in self.populations:
            self.populations[key] = Acceptance(memory=POPULATION_MEMORY)
        return self.populations[key]

    def outside_ms(self, rows: int = 1) -> float:
        """S(rows): what a step of ``rows`` rows that drafts nothing spends outside its forward."""
        return self.pace * _lookup(self._settled(OUTSIDE, self.outside), rows)

    def observe_outside(self, rows: int, ms: float) -> None:
        self._observe(OUTSIDE, self.outside, rows, ms)

    def observe_target(self, width: int, ms: float, rows: int = 1, context: int = 0) -> None:
        """File a forward of ``rows`` rows of ``width`` tokens (one row's after ``context`` positions) that took
        ``ms``."""
        band, key = context_band(context), target_key(rows, context)
        measured = self.batches.setdefault(rows, {}) if rows > 1 else self.longer.setdefault(band, {}) if band \
            else self.target
        cost = measured.get(width)
        if not cost or (key, width) in self.trials or ms <= 0:
            self._observe(key, measured, width, ms)
            return
        # Both move by fixed shares of one clamped log-ratio, so a size run alone keeps its cost and the pace in a
        # fixed proportion (c ~ P^(1/9)): as the pace returns, so does c. Updated one after the other, or by
        # clamps in milliseconds, the two split each pass's news unevenly, and 5,000 passes of one size with
        # spikes moved its cost 2.9x against the others', the pace the other way.
        self.updates += 1
        r = max(-PACE_CLAMP, min(PACE_CLAMP, math.log(ms / (self.pace * cost))))
        self.pace *= math.exp(PACE_SHARE * r)
        measured[width] = cost * math.exp((1 - PACE_SHARE) * r)

    def observe_prompt(self, width: int, ms: float) -> None:
        """File one row's prompt pass of ``width`` tokens (``width`` rows of the cache written, one row of logits)
        that took ``ms``: a guide to widths wider than every settled one, which are priced on the line from the
        widest settled width to the nearest wider prompt pass, where they were priced as that widest width.

        Why: a first answer (no profile yet) priced every untried width at its 1-token pass's cost, so the planner
        ran its widest trees first, three times each before their costs counted. On the 2-core AVX2 EPYC the README
        main command's first answer (a process's first ``generate``, from an empty profile) took 1.032 s with this
        guide against 1.148 s without (medians of 6 processes each, alternating; 1.043 and 1.188 s means). A
        prompt pass computes one row of logits where a verification of as many tokens computes all of them, so the
        line errs low, as a price for an untried size should (see the class): untried widths are still run and
        measured, only no longer as though they cost a 1-token pass. Kept for this process only (in the pace's
        units): a saved profile has settled widths of its own."""
        if ms > 0:
            self.prompts[width] = ms / self.pace

    def remeasure(self, key: str, size: int) -> None:
        """Measure ``key``'s ``size`` afresh (``key``: a drafter's, or ``target_key``'s for a pass): its next
        ``TRIALS`` measurements set its cost, as a new size's do (their least, where it is below what is held; until
        then the planner prices the size from its neighbours). Settled, a cost moves by ``STRIDE`` at most a
        measurement, so a size priced far too high, which the planner then seldom runs, would take tens of runs to
        come right; ``engine.REFRESH`` says when this is asked."""
        self.trials[key, size] = 0

    def set_measured(self, key: str, sizes: dict[int, float]) -> None:
        """Take ``sizes`` (size -> milliseconds, measured just now, as ``fuzzyspec tune`` does) as the settled costs
        of the target's one-row passes (``key`` ``TARGET``), of steps' time outside the forward (``OUTSIDE``) or
        of a drafter's key, in place of what was held. Filed over the pace, as every cost is, so each reads back
        as given whatever the pace is now."""
        table = self.target if key == TARGET else self.outside if key == OUTSIDE else self.draft.setdefault(key, {})
        for size, ms in sizes.items():
            table[size] = ms / self.pace
            self.trials.pop((key, size), None)

    def observe_draft(self, key: str, size: int, ms: float) -> None:
        self._observe(key, self.draft.setdefault(key, {}), size, ms)

    def _observe(self, key: str, measured: dict[int, float], size: int, ms: float) -> None:
        self.updates += 1
        ms /= self.pace
        count = self.trials.get((key, size), 0 if size not in measured else None)
        if count is None:
            _fold(measured, size, ms)
            return
        measured[size] = min(measured.get(size, ms), ms)
        if count + 1 < TRIALS:
            self.trials[key, size] = count + 1
        else:
            self.trials.pop((key, size), None)

    def _settled(self, key: str, measured: dict[int, float]) -> dict[int, float]:
        return {size: ms for size, ms in measured.items() if (key, size) not in self.trials}

    def to_dict(self) -> dict:
        """The settled measurements (a tentative size is measured anew next time)."""
        def settled(key: str, sizes: dict[int, float]) -> dict[str, float]:
            return {str(k): self.pace * v for k, v in sorted(self._settled(key, sizes).items())}

        return {"target": settled(TARGET, self.target),
                "draft": {key: settled(key, sizes) for key, sizes in self.draft.items()},
                "batches": {str(rows): settled(_batch_key(rows), sizes)
                            for rows, sizes in sorted(self.batches.items())},
                "outside": settled(OUTSIDE, self.outside),
                "longer": {str(band): settled(_band_key(band), sizes) for band, sizes in sorted(self.longer.items())},
                "acceptance": {key: {"reached": {str(k): v for k, v in population.reached.items()},
                                     "passed": {str(k): v for k, v in population.passed.items()}}
                               for key, population in self.populations.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        def sizes(measured: dict) -> dict[int, float]:
            return {int(k): float(v) for k, v in measured.items()}

        def counts(by_breadth: dict) -> dict[int, list[float]]:
            return {int(k): [float(x) for x in v] for k, v in by_breadth.items()}

        populations = {key: Acceptance(counts(value.get("reached", {})), counts(value.get("passed", {})),
                                       memory=POPULATION_MEMORY)
                       for key, value in data.get("acceptance", {}).items()}
        return cls(sizes(data.get("target", {})), {key: sizes(value) for key, value in data.get("draft", {}).items()},
                   {int(rows): sizes(value) for rows, value in data.get("batches", {}).items()},
                   sizes(data.get("outside", {})), populations,
                   longer={int(band): sizes(value) for band, value in data.get("longer", {}).items()})


def target_key(rows: int = 1, context: int = 0) -> str:
    """The key a target pass of ``rows`` rows (one row's after ``context`` positions) is filed under among the
    tentative sizes' (``Profile.trials``)."""
    band = context_band(context)
    return _batch_key(rows) if rows > 1 else _band_key(band) if band else TARGET


def _batch_key(rows: int) -> str:
    """The key of a batch of ``rows`` rows' target costs among the tentative sizes' (drafters' keys name a
    drafter)."""
    return f"{TARGET}x{rows}"


def _band_key(band: int) -> str:
    """The key of one row's target costs in a band of longer contexts among the tentative sizes'."""
    return f"{TARGET}@{band}"


def _lookup(measured: dict[int, float], x: int) -> float:
    """Measured at x, else interpolated between neighbours, else the nearest narrower measurement (an
    untried larger size looks no dearer than a smaller one, so it gets tried); 0 with nothing measured."""
    if x in measured:
        return measured[x]
    below = [k for k in measured if k < x]
    above = [k for k in measured if k > x]
    if below and above:
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (x - lo) / (hi - lo)
    if below:
        return measured[max(below)]
    return measured[min(above)] if above else 0.0


def _fold(measured: dict[int, float], x: int, ms: float) -> None:
    """A running median: each measurement moves the estimate ``STRIDE`` of itself towards it (at most all the way).
    A running mean (a fifth of the way, up to half the estimate) sat above the median on a shared machine's
    spikes, and unevenly: a size the planner stopped running kept the last spike it met while the sizes it ran
    came back down (a 2-token compiled step stuck at 1.38x a 1-token one, whose steps measured 1.12x)."""
    old = measured.get(x)
    measured[x] = ms if old is None else old + max(-STRIDE * old, min(STRIDE * old, ms - old))


@dataclass
class Acceptance:
    """A row's running chance that a draft at depth j is accepted given the drafts above it were, per breadth k
    (children per node), with fading counts and a prior.

    One step informs every breadth up to the one it drafted: where a k-wide draft's accepted child is its
    parent's r-th most likely, a draft r or more wide would have kept it, a narrower one would have stopped
    there. (An estimate: a narrower EAGLE-2 tree also expands fewer nodes per level.) A chain informs k = 1."""

    reached: dict[int, list[float]] = field(default_factory=dict)  # breadth -> per depth
    passed: dict[int, list[float]] = field(default_factory=dict)
    population: "Acceptance | None" = None  # the drafter's acceptance over every row so far: this row's prior
    memory: float = MEMORY  # how much of its counts a step keeps

    def rate(self, depth: int, breadth: int = 1) -> float:
        """a_depth(breadth) (depth 1: the first draft), from the row's counts and its prior: the drafter's
        population's rate where it has one, else ``PRIOR_ACCEPTANCE`` widened to the breadth."""
        return self.rates(depth, breadth)[-1]

    def rates(self, cap: int, breadth: int = 1, doubt: float = 0.0) -> list[float]:
        """a_1(breadth) .. a_cap(breadth) (see ``rate``), worked out together (the planner reads them every step);
        each raised by ``doubt`` standard errors, a(1 - a) over the drafts it stands on (the row's, faded, and the
        prior's ``PRIOR_WEIGHT``), where ``doubt`` is given."""
        priors = self.population.rates(cap, breadth) if self.population is not None else \
            [widened(PRIOR_ACCEPTANCE, breadth)] * cap
        reached, passed = self.reached.get(breadth, []), self.passed.get(breadth, [])
        counted = len(reached)
        rates = []
        for i, prior in enumerate(priors):
            drafts = (reached[i] if i < counted else 0.0) + PRIOR_WEIGHT
            rate = ((passed[i] if i < counted else 0.0) + prior * PRIOR_WEIGHT) / drafts
            rates.append(min(1.0, rate + doubt * math.sqrt(rate * (1 - rate) / drafts)) if doubt else rate)
        return rates

    def expected(self, cap: int, breadth: int = 1, doubt: float = 0.0) -> list[float]:
        """E(g, breadth) for g = 0 .. cap: tokens a step yields with drafts g deep (with acceptances raised by
        ``doubt`` standard errors: ``rates``)."""
        totals, chance = [1.0], 1.0
        for rate in self.rates(cap, breadth, doubt):
            chance *= rate
            totals.append(totals[-1] + chance)
        return totals

    def fade(self) -> None:
        """One step older: every count fades by ``MEMORY``. A step that drafted nothing fades them too, so a
        row that stopped drafting after a poor stretch drifts back to the prior and tries again (with counts
        that only faded when it drafted, one bad stretch stopped a row's drafting for the rest of its answer)."""
        for counts in (*self.reached.values(), *self.passed.values()):
            counts[:] = [value * self.memory for value in counts]

    def record(self, proposed: int, ranks: list[int], breadth: int = 1) -> None:
        """A step that drafted ``proposed`` deep, ``breadth`` children per node, and kept a path whose nodes
        were their parents' ``ranks``-th most likely children (1: the likeliest; a chain's are all 1). For each
        breadth k up to ``breadth``, the path a k-wide draft keeps is the prefix of ranks <= k: depths 1 .. its
        length + 1 were reached (if drafted), 1 .. its length passed. The population learns it too."""
        if self.population is not None:
            self.population.record(proposed, ranks, breadth)
        self.fade()
        for k in range(1, breadth + 1):
            kept = next((i for i, rank in enumerate(ranks) if rank > k), len(ranks))
            reached, passed = self.reached.setdefault(k, []), self.passed.setdefault(k, [])
            while len(reached) < proposed:
                reached.append(0.0)
                passed.append(0.0)
            for i in range(min(kept + 1, proposed)):
                reached[i] += 1
            for i in range(kept):
                passed[i] += 1


def widened(rate: float, breadth: int) -> float:
    """The acceptance a draft ``breadth`` children wide is assumed to reach where a chain's is ``rate``: each
    further child catches ``PRIOR_WIDER`` of what the ones before it missed."""
    return 1 - (1 - rate) * (1 - PRIOR_WIDER) ** (breadth - 1)


def breadths(top_k: int) -> list[int]:
    """The breadths the planner weighs for trees of at most ``top_k`` children per node: 1 (a chain), the
    powers of two below ``top_k``, and ``top_k``."""
    return sorted({1, top_k} | {1 << i for i in range(top_k.bit_length()) if 1 << i < top_k})


@dataclass(frozen=True)
class Option:
    """What a row of drafter ``drafter`` can draft: chains up to ``cap`` deep, or (``tree``: total nodes and
    children per node, at most) trees up to ``cap`` deep at each of ``breadths(children)``."""

    drafter: str
    cap: int                   # the largest depth (gamma, or the tree's depth)
    tree: tuple[int, int] | None = None  # (total nodes, children per node) for trees

    @classmethod
    def of(cls, drafter: str, config, cap: int | None = None) -> "Option":
        """What a row of ``config`` (a ``DecodeConfig``) drafting with ``drafter`` can draft, its depth capped at
        ``cap`` too where given."""
        depth = config.size_cap if cap is None else min(config.size_cap, cap)
        return cls(drafter, depth, (config.tree_total_tokens, config.tree_top_k) if config.tree else None)

    def breadths(self) -> list[int]:
        """The breadths a row may draft at: 1 (chains) alone, or ``breadths`` of its tree's children."""
        return breadths(self.tree[1]) if self.tree is not None else [1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (depth, breadth) a row may draft, (0, 1) (nothing) first."""
        return [(0, 1)] + [(size, k) for k in self.breadths() for size in range(1, self.cap + 1)]

    def nodes(self, size: int, breadth: int = 1) -> int:
        return tree_nodes(size, self.tree[0], breadth) if self.tree is not None else size

    def widths(self) -> tuple[int, ...]:
        """Every width (the newest token and the drafts) a row of this option may ask the target to verify."""
        return tuple(sorted({1 + self.nodes(*shape) for shape in self.shapes()}))

    def key(self, breadth: int = 1) -> str:
        """Whose drafting costs a draft of this breadth adds to: the drafter's chains or its trees that wide."""
        return draft_key(self.drafter, breadth)


def population_key(drafter: str, method: str, threshold: float, greedy: bool) -> str:
    """Whose acceptance a row adds to: a drafter, judged by a rule (a fuzzy rule's threshold changes what passes),
    greedy or sampled."""
    return f"{drafter}|{method}|{threshold:g}|{'greedy' if greedy else 'sampled'}"


def draft_key(drafter: str, breadth: int) -> str:
    """The profile's key of ``drafter``'s drafting at ``breadth`` children per node (1: a chain)."""
    return f"{drafter}:chain" if breadth == 1 else f"{drafter}:tree{breadth}"


def plan(options: list[Option], acceptances: list[Acceptance], profile: Profile,
         shape: Callable[[int, int], tuple[int, int]] = lambda width, rows: (width, rows), others: int = 0,
         rounds: int = 3, context: int = 0) -> list[tuple[int, int]]:
    """Every row's draft (depth, breadth) ((0, 1): none) maximising the step's expected tokens per millisecond
    (see the module docstring): each row in turn takes its best draft given the others', a few rounds over the
    rows; ties go to the smaller draft. ``shape(width, rows)``: the padded shape a step of that many tokens per
    row and rows runs at (every row is verified at the widest row's width); ``others``: rows of the step that
    are not planned here; ``context``: the longest row's positions, which one row's passes are priced after."""
    rows = len(options) + others
    # Each shape's tokens, nodes and drafting cost are fixed for this step: worked out once per row, so the rounds
    # below are arithmetic (the planner runs every step; evaluating each candidate from scratch took 0.7 ms a step
    # under a profiler, 0.1 ms now unprofiled for trees up to 8 wide and 6 deep).
    tables = [_candidates(option, acceptance, profile) for option, acceptance in zip(options, acceptances)]
    hopes: dict[int, list] = {}  # a row's candidates with its acceptances raised (``DOUBT``), made where it would stop
    outside = profile.outside_ms(rows)
    forward: dict[int, float] = {}  # by nodes
    padded: dict[tuple[int, int], float] = {}  # by the shape a step runs at (many node counts share one)

    def forward_ms(nodes: int) -> float:
        if nodes not in forward:
            runs_at = shape(1 + nodes, rows)
            if runs_at not in padded:
                padded[runs_at] = profile.target_ms(*runs_at, context=context)
            forward[nodes] = padded[runs_at]
        return forward[nodes]

    chosen = [(0, 1)] * len(options)
    picked = [table[0] for table in tables]  # (shape, tokens, nodes, drafting ms) of each row's choice
    for _ in range(rounds if len(options) > 1 else 1):  # one row's best does not depend on a previous round
        changed = False
        for b, table in enumerate(tables):
            tokens = others + sum(entry[1] for i, entry in enumerate(picked) if i != b)
            drafting = outside + sum(entry[3] for i, entry in enumerate(picked) if i != b)
            widest = max((entry[2] for i, entry in enumerate(picked) if i != b), default=0)

            def rate(entry: tuple) -> float:
                ms = forward_ms(max(widest, entry[2])) + drafting + entry[3]
                return (tokens + entry[1]) / ms if ms > 0 else math.inf

            def order(entry: tuple) -> tuple:
                return rate(entry), -entry[2], -entry[0][0]

            best = max(table, key=order)
            if best[0] == (0, 1) and DOUBT:
                if b not in hopes:
                    hopes[b] = _candidates(options[b], acceptances[b], profile, DOUBT)
                if max(hopes[b], key=order)[0] != (0, 1):  # not sure enough to stop
                    best = max(table[1:], key=order)
            changed |= best[0] != chosen[b]
            chosen[b], picked[b] = best[0], best
        if not changed:
            break
    return chosen


def speedup(option: Option, acceptance: Acceptance, profile: Profile, context: int = 0) -> tuple[tuple[int, int], float]:
    """The draft (depth, breadth) ``plan`` picks for one row, and the tokens per millisecond it expects of it over
    AR's by the same measure: E(g, k) / (T(1 + n) + S + D(g, k)) against 1 / (T(1) + S). 1.0 where it drafts
    nothing; below it only where the row's acceptance is too uncertain to stop drafting on (``DOUBT``)."""
    (chosen,) = plan([option], [acceptance], profile, context=context)
    if chosen == (0, 1):
        return chosen, 1.0
    _, tokens, nodes, drafting = next(entry for entry in _candidates(option, acceptance, profile) if entry[0] == chosen)
    outside = profile.outside_ms(1)
    ms = profile.target_ms(1 + nodes, context=context) + outside + drafting
    return chosen, tokens * (profile.target_ms(1, context=context) + outside) / ms if ms > 0 else math.inf


def copy_length(acceptance: Acceptance, profile: Profile, cap: int,
                shape: Callable[[int, int], tuple[int, int]] = lambda width, rows: (width, rows), rows: int = 1,
                context: int = 0) -> int:
    """How many tokens a draft copied from the text (``drafters.lookup.CopyFirst``) may hold, 1 .. ``cap``: the
    length g maximising E(g) / (T(shape(1 + g, rows)) + S(rows)), E from the copies' own acceptance (kept apart
    from the drafter's: a copy's tokens pass more often) and no drafting cost (a copy takes no model pass); ties
    go to the shorter. A copy is at least one token: where the text repeats itself, its first copied token passed
    67-72% of the time in decoding against the shipped head's ~50% (2026-11-26), so a copy is not weighed against
    the planned draft. Every row is assumed to run at that width (the others' drafts are not known yet when rows
    copy: ``CopyFirst`` decides at proposal); T is priced after ``context`` positions (the longest row's)."""
    if cap < 1:
        return 0
    expected, outside = acceptance.expected(cap), profile.outside_ms(rows)

    def rate(length: int) -> float:
        ms = profile.target_ms(*shape(1 + length, rows), context=context) + outside
        return expected[length] / ms if ms > 0 else math.inf

    return max(range(1, cap + 1), key=lambda length: (rate(length), -length))


def _candidates(option: Option, acceptance: Acceptance, profile: Profile, doubt: float = 0.0
                ) -> list[tuple[tuple[int, int], float, int, float]]:
    """(shape, expected tokens, nodes, drafting ms) of every shape ``option`` may draft (``Option.shapes``; (0, 1)
    first), acceptances raised by ``doubt`` standard errors (``Acceptance.rates``)."""
    expected = {breadth: acceptance.expected(option.cap, breadth, doubt) for breadth in option.breadths()}
    costs = {breadth: profile.draft_costs(option.key(breadth)) for breadth in option.breadths()}
    return [((depth, breadth), expected[breadth][depth], option.nodes(depth, breadth),
             _lookup(costs[breadth], depth) if depth else 0.0) for depth, breadth in option.shapes()]
