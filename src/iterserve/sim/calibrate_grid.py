"""The calibration grid: the batch shapes ``calibrate`` times, and the rule that fits a
shape to the model's context (each request's prompt plus the outputs the shape needs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

# The most context tokens (batch x prompt) a grid point of 16 or more sequences takes.
MAX_BATCH_TOKENS = 32768


@dataclass(slots=True)
class GridPoint:
    batch_size: int  # requests decoding together
    context_len: int  # prompt length of each
    chunk: int  # max_num_batched_tokens while prefilling
    decode_steps: int = 8
    # Prompt lengths spread evenly over [context_len * (1 - spread), context_len]:
    # decodes of unequal contexts (padding in the runner's decode groups) and
    # prefill steps packing several prompts of different lengths.
    spread: float = 0.0
    # A prompt of this many tokens arriving once the batch decodes: its chunks run
    # beside ``batch_size`` decodes (mixed steps, as a long prompt arriving on a
    # busy server is computed). 0: none.
    late_prompt: int = 0


def default_grid(quick: bool = False, max_context: int = 2048,
                 kv_tokens: int | None = None) -> list[GridPoint]:
    """Batch size x context length, with prefill chunks from 64 tokens to 2048
    (several prompts per step) and every other point's prompt lengths spread, so
    that the grid covers the decode batch x context plane up to 64 sequences, mixed
    prefill + decode steps, and padded decode groups. A point's chunk is at least
    1/16 of its prompt tokens (at most ~16 prefill steps); ``kv_tokens`` (the KV
    cache's capacity) caps batch x context so calibration never preempts.

    Over long contexts it adds what the long-context terms (``long_context.py``) are
    fitted on: a few sequences (odd counts, spread lengths: the decode kernel deals rows
    whole to its threads) at contexts up to ``max_context``, and long prompts chunked
    beside long decodes (prefill chunks at deep offsets in mixed steps). Batches of 16
    or more stop at ``MAX_BATCH_TOKENS`` of context: their prompts are most of a full
    calibration's time, and past that they price a token as the smaller ones do.

    The quick grid keeps the three kinds of decode cost apart with few points:
    uniform short and long contexts (per sequence, per context token) and spread
    long ones (padding), and spans batches up to 64 (held-out shapes lie inside)."""
    chunks = (64, 512, 2048, 256, 1024)
    # (batch, context, chunk, spread, late prompt)
    points: list[tuple[int, int, int, float, int]]
    if quick:
        steps = 4
        points = [(1, 64, 256, 0.0, 0), (1, 512, 2048, 0.0, 0), (8, 64, 2048, 0.0, 0),
                  (8, 512, 256, 0.75, 0), (16, 512, 2048, 0.0, 0), (32, 64, 256, 0.0, 0),
                  (32, 512, 2048, 0.75, 0), (64, 128, 2048, 0.0, 0),
                  # long prompts: whole (causal) and chunked on long prefixes (masked)
                  (2, 2048, 2048, 0.0, 0), (4, 1536, 1024, 0.5, 0),
                  # a few long rows of unequal length (idle threads, cost per token)
                  (3, max_context, 256, 0.5, 0)]
    else:
        steps = 8
        points = []
        # Small batches twice over (2, 8): below ~8 sequences a decode step's cost bends
        # away from the line the large batches draw, and batch 1 has a path of its own.
        # Contexts up to the model's own: long contexts are where decode's KV read and
        # attention's quadratic part dominate, and a fit that never saw them extrapolates.
        long = tuple(c for c in (4096, 8192, 16384, 32768) if c < max_context)
        contexts = (64, 256, 512, 1024, 2048, *long,
                    *((max_context,) if max_context > 2048 else ()))
        for i, b in enumerate((1, 2, 4, 8, 16, 32, 64)):
            for j, c in enumerate(contexts):
                if c > 2048 and b > 8:
                    continue  # the KV pool caps these anyway; small batches cover the range
                if b >= 16 and b * min(c, max_context) > MAX_BATCH_TOKENS:
                    continue
                spread = 0.75 if b > 1 and ((i + j) % 2 or c >= max_context) else 0.0
                points.append((b, c, chunks[(i + j) % len(chunks)], spread, 0))
        points += [(3, max_context, 256, 0.5, 0), (5, 1536, 512, 0.75, 0),
                   (6, max_context, 1024, 0.0, 0), (3, 1024, 64, 0.0, 0),
                   *((3, c, 1024, 0.5, 0) for c in long),
                   (4, 1536, 256, 0.5, max_context), (8, 1024, 512, 0.0, max_context * 3 // 4)]
    grid = []
    seen = set()
    for b, c, chunk, spread, late in points:
        # The longest contexts are clipped to what the model and pool allow, not
        # dropped: long prompts are where attention's quadratic part shows.
        c, late = min(c, max_context), min(late, max_context)
        if (b, c, spread, late) in seen:
            continue
        seen.add((b, c, spread, late))
        chunk = max(chunk, min((x for x in chunks if 16 * x >= b * c), default=max(chunks)))
        if kv_tokens is not None:
            # prompts (mean length c * (1 - spread / 2)) + outputs (prefill + decode steps)
            room = (kv_tokens * 0.9 - late) / b - (b * c // chunk + steps + 2)
            c = min(c, int(room / (1 - spread / 2)))
            if c < 16:
                continue
        grid.append(GridPoint(b, c, chunk, steps, spread, late if late >= 16 else 0))
    return grid


def heldout_grid(quick: bool = False, max_context: int = 2048,
                 kv_tokens: int | None = None) -> list[GridPoint]:
    """Shapes the default grid never times, to measure how the fit generalises:
    batch sizes, contexts and chunk sizes between its points, long contexts, and
    long prompts chunked beside many decodes (``late_prompt``), the steps a server
    runs when long prompts arrive while others decode."""
    if quick:
        steps = 3
        points = [(3, 384, 384, 0.0, 0), (12, 768, 768, 0.5, 0), (24, 96, 128, 0.5, 0),
                  (16, 256, 768, 0.5, 1536), (48, 160, 384, 0.5, 1024)]
    else:
        steps = 4
        points = [(3, 384, 384, 0.0, 0), (6, 1536, 1536, 0.5, 0), (12, 768, 768, 0.5, 0),
                  (24, 96, 128, 0.5, 0), (40, 192, 768, 0.0, 0), (2, 1800, 384, 0.0, 0),
                  (16, 256, 768, 0.5, 1536), (48, 160, 384, 0.5, 1024),
                  (32, 640, 1536, 0.5, 1900), (8, 1200, 192, 0.5, 700),
                  # a few long rows past the grid's knots (clipped to the context)
                  (5, 3000, 512, 0.5, 0)]
    grid = []
    for b, c, chunk, spread, late in points:
        c, late = min(c, max_context), min(late, max_context)
        if kv_tokens is not None:
            room = kv_tokens * 0.9 - late - 64
            c = min(c, int(room / b / (1 - spread / 2)) - (b * c // chunk + steps + 2))
            if c < 16:
                continue
        grid.append(GridPoint(b, c, chunk, steps, spread, late))
    return grid


def step_budget(p: GridPoint) -> int:
    """The shape's max_num_batched_tokens: its chunk, and with a late prompt its chunks
    beside the decodes."""
    return max(p.chunk, p.batch_size) + (p.batch_size if p.late_prompt else 0)


def max_tokens_of(p: GridPoint) -> int:
    """Outputs per request: early members decode while later ones prefill, and long
    enough outputs leave ``decode_steps`` steps with the whole batch decoding after the
    last prefill (and the late prompt's chunks)."""
    prefill_steps = -(-p.batch_size * p.context_len // step_budget(p))
    late_steps = -(-p.late_prompt // p.chunk) if p.late_prompt else 0
    return p.decode_steps + prefill_steps + late_steps + 1


def fit_to_context(p: GridPoint, max_model_len: int) -> GridPoint | None:
    """``p`` with its prompts shortened so that every request fits ``max_model_len``
    (prompt + outputs; the late prompt + its 2 outputs); None when under 16 tokens of
    prompt would be left."""
    late = min(p.late_prompt, max_model_len - 2)
    q = replace(p, late_prompt=late if late >= 16 else 0)
    while q.context_len + max_tokens_of(q) > max_model_len:
        c = min(q.context_len - 1, max_model_len - max_tokens_of(q))
        if c < 16:
            return None
        q = replace(q, context_len=c)
    return q


def shape_name(p: GridPoint) -> str:
    late = f", late prompt {p.late_prompt}" if p.late_prompt else ""
    return f"shape (batch {p.batch_size}, context {p.context_len}, chunk {p.chunk}{late})"


def vars_of(p: GridPoint) -> dict[str, float]:
    return {"batch_size": p.batch_size, "context_len": p.context_len, "chunk": p.chunk,
            "decode_steps": p.decode_steps, "spread": p.spread, "late_prompt": p.late_prompt}
