"""``compression_params='auto'``: the job's push and pull codecs, chosen at its hand-shake.

The codec fixes the key layout at the hand-shake (docs/design.md §2.8, §2.12, §2.14), so the
choice is made then, at the first step, from what can be measured before any key exists
(docs/design.md §2.16):

- the link: rank 0 sends PROBE commands of two sizes to every server and times them; the
  difference cancels the fixed cost of a command, and the slope is the rate of its link
  (:func:`probe_rate`; ``MXDELAY_AUTO_CODEC_LINK`` pins it instead);
- the codecs' CPU on this machine, for this model: the kernels the job would run, over the
  model's own tensor sizes, on the worker's side and the servers' (:func:`codec_seconds`);
- the bytes of a step of each candidate, from the codecs' payload sizes (:func:`wire_bytes`).

Each candidate's step is estimated as its wire time through the busiest server's link plus
its codecs' CPU (:func:`estimate`); compute cannot be seen yet and is the same for all. The
cheapest supported candidate wins, but a codec only where it beats no codec clearly
(:func:`decide`). Rank 0 chooses; the hand-shake gives its choice to the servers and the
other workers (:mod:`kvstore_ext.worker.session`).
"""
import collections
import logging
import time

import numpy as np

from kvstore_ext import codecs, env
from kvstore_ext.codecs import kernels, pulls
from kvstore_ext.worker.bytecount import chunk_bytes
from kvstore_ext.worker.layout import split

__all__ = ['Candidate', 'CANDIDATES', 'SUPPORT', 'CPU_WEIGHT', 'MARGIN', 'DEFAULT_DELAY',
           'Request', 'supported', 'wire_bytes', 'codec_seconds', 'probe_rate', 'estimate',
           'decide', 'pinned_arguments', 'choose']

_LOG = logging.getLogger(__name__)

#: One configuration auto may choose: its name, ``compression_params`` and
#: ``pull_compression`` (each None or a dict).
Candidate = collections.namedtuple('Candidate', 'name push pull')

_INT8_PULL = {'type': 'int8', 'block_size': 256}
#: The candidates, cheapest in CPU first (a tie goes to the earlier one).
CANDIDATES = (Candidate('none', None, None),
              Candidate('fp16', {'type': 'fp16'}, None),
              Candidate('fp16+int8', {'type': 'fp16'}, _INT8_PULL),
              Candidate('ternary+int8', {'type': 'ternary', 'block_size': 256}, _INT8_PULL))

_ALL = tuple(c.name for c in CANDIDATES)
_FP16_ROW = "docs/tuning.md row 'float16 pushes' (0.02 points after 10 epochs)"
#: optimizer type (lower case) -> (the candidates docs/tuning.md's accuracy rows support for
#: it, which rows). Any other optimizer: :data:`_OTHER`.
SUPPORT = {
    'sgd': (_ALL, _FP16_ROW + "; rows 'compressed pulls' and 'blockwise pushes' (SGD with "
                              'momentum: within 0.5 points at epochs 5 and 10)'),
    'nag': (_ALL, _FP16_ROW + "; rows 'compressed pulls' and 'blockwise pushes' (SGD with "
                              'momentum; NAG is its Nesterov form)'),
    'frozenvarianceadam': (_ALL, _FP16_ROW + "; row 'blockwise pushes' ('With Adam, only as "
                                             "frozenvarianceadam': +0.24, +0.21 points)"),
    'adam': (('none', 'fp16'), _FP16_ROW + "; row 'blockwise pushes': plain 'adam' dipped to "
                                           '0.8548 with ternary; no row for its compressed pulls'),
}
_OTHER = (('none', 'fp16'), _FP16_ROW + '; no accuracy row for this optimizer with the others')

#: How much more a codec costs a step than its kernels' fastest time (the codecs' other
#: work, and contention for the cores). In the envelope (docs/benchmarks/scaling/envelope/
#: summary.md, MLP, 2 workers, 1 server, k=4) ternary + int8 pulls took 65 ms a step less
#: than k=4 alone at 1gbit (136 against 201 ms: 256 samples at 1882 and 1272 samples/s)
#: where they save 114 ms of wire (the server link's byte floor, 122 against 8 ms): 49 ms
#: of cost, about 10x the 4-7 ms their kernels take for that model at their fastest
#: (docs/benchmarks/auto-codec/results.md). At 10gbit the same comparison gives about 20x,
#: on a machine loaded twice as much.
CPU_WEIGHT = 10.0
#: A codec is chosen only when its estimated step is at most this share of no codec's: the
#: estimate sees neither compute nor the servers' other work. With :data:`CPU_WEIGHT` it puts
#: the MLP's break-even for ternary + int8 pulls near 2 Gbit/s, and the rows it was checked
#: against come out as measured: no codec on the envelope's 10gbit links (one TCP stream
#: carried 3.2 Gbit/s there; k=4 alone 1.10x stock, + fp16 1.06x, + ternary + int8 pulls
#: 0.76x), ternary + int8 pulls at 1gbit (2.04x; k=4 + fp16 1.74x, k=4 1.38x). fp16 alone
#: saves at most 40% of the wire at k=4 (0.6 of it is left), so it needs a margin above 0.6.
MARGIN = 0.7
#: The delay k assumed when the trainer's is not known yet (``delay='auto'``).
DEFAULT_DELAY = 4
#: Bytes of the two probes: at 100 Mbit/s the larger takes about 0.1 s.
_PROBE_BYTES = (1 << 18, 1 << 20)
_PROBE_REPEATS = 3
#: Elements of the model the CPU is timed over at most (the rest is scaled from it).
_TIMED_ELEMENTS = 1 << 21
_KERNEL_REPEATS = 3


class Request(object):
    """What the trainer tells the store for ``compression_params='auto'``.

    Parameters
    ----------
    sizes : callable
        ``sizes()``: element counts of the trained tensors (called at the hand-shake, when
        deferred shapes are known).
    delay : int or None
        k; None: :data:`DEFAULT_DELAY`.
    restriction : callable
        ``restriction()``: None, or why only 'none' may be chosen (e.g. AMP).
    resumed : callable, optional
        ``resumed()``: the codecs of the checkpoint the job will resume from
        (``{'compression_params': ..., 'pull_compression': ...}``), which are kept, or None.
    """

    def __init__(self, sizes, delay, restriction, resumed=None):
        self.sizes, self.restriction = sizes, restriction
        self.delay = delay if isinstance(delay, int) else DEFAULT_DELAY
        self.resumed = resumed or (lambda: None)


def supported(optimizer_type):
    """``(names, rows)``: the candidates supported for `optimizer_type` and why."""
    return SUPPORT.get(str(optimizer_type).lower(), _OTHER)


def wire_bytes(candidate, sizes, chunk_size, num_workers):
    """``(push, pull)``: bytes one worker's push and one pull of the whole model carry."""
    codec = codecs.parse(candidate.push) or codecs.NONE
    limit = min(chunk_size, codec.chunk_limit(num_workers) or chunk_size)
    chunks = [stop - start for size in sizes for start, stop in split(size, limit)]
    return chunk_bytes(codec, pulls.parse(candidate.pull), chunks, np.float32)


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def _fastest(function, *args, **kwargs):
    """The fastest of :data:`_KERNEL_REPEATS` calls (into preallocated outputs, as the job's
    own buffers): other processes' bursts on the cores are not the codec's cost."""
    return min(_timed(function, *args, **kwargs) for _ in range(_KERNEL_REPEATS))


def codec_seconds(candidate, sizes, num_workers, num_servers, delay):
    """CPU seconds a step of `candidate` spends in its codecs' kernels: the worker's encode
    and pull decode, and one server's decode of the pushes and pull encode (a server holds
    1/`num_servers` of the model; a pull every `delay` steps), timed over the model's own
    tensors (the first :data:`_TIMED_ELEMENTS` elements of them, scaled to the rest)."""
    if candidate.push is None and candidate.pull is None:
        return 0.0
    push, pull = codecs.parse(candidate.push), pulls.parse(candidate.pull)
    _kernel_seconds(push, pull, 1024, num_workers, delay)   # loads the kernels, untimed
    timed, worker, server = 0, 0.0, 0.0
    for n in sizes:
        if timed >= _TIMED_ELEMENTS:
            break
        seconds = _kernel_seconds(push, pull, n, num_workers, delay)
        timed, worker, server = timed + n, worker + seconds[0], server + seconds[1]
    return float(sum(sizes)) / max(timed, 1) * (worker + server / num_servers)


def _kernel_seconds(push, pull, n, num_workers, delay):
    """``(worker, server)`` seconds of the kernels of codecs `push` and `pull` on a tensor of
    `n` elements, per step."""
    grad = np.random.RandomState(0).standard_normal(n).astype(np.float32)
    values = np.zeros(n, dtype=np.float32)
    worker = server = 0.0
    if push is not None and push.type_name == 'fp16':
        half = np.zeros(n, dtype=np.float16)
        worker += _fastest(kernels.to_float16, grad, out=half)
        # The native servers cast each worker's float16 push to float32 and sum.
        server += num_workers * _fastest(kernels.to_float32, half, out=values)
    elif push is not None:
        residual = np.zeros(n, dtype=np.float32)
        worker += _fastest(kernels.encode_with_feedback, grad, residual, push.levels,
                           push.block, out=values)
        rows = np.tile(kernels.encode(grad, push.levels, push.block)[0], (num_workers, 1))
        server += _fastest(kernels.decode_sum, rows, list(range(num_workers)), push.levels,
                           push.block, n, out=values, threads=kernels.cores())
    if pull is not None:
        model = np.zeros(n, dtype=np.float32)
        payload = np.zeros(pull.payload_size(n), dtype=np.float32)
        server += _fastest(pull.broadcast, grad, model, payload, kernels.cores()) / delay
        worker += _fastest(kernels.int8_pull_decode_add, payload, values, n,
                           pull.block_size) / delay
    return worker, server


def probe_rate(send, num_servers, sizes=_PROBE_BYTES, repeats=_PROBE_REPEATS):
    """Bytes per second of this worker's link to the servers, from PROBE commands.

    ``send(nbytes)`` sends one probe of `nbytes` bytes to every server and returns when each
    has answered. Each of the two `sizes` is sent `repeats` times, interleaved, and the
    fastest of each taken; the rate is the slope, ``num_servers * (big - small) / (t_big -
    t_small)`` (every server's copy crosses this worker's link, and the fixed cost of a
    command cancels). Infinite where the two times do not differ (a link too fast for the
    probe to see).

    Not larger probes: ps-lite carries a command's body in its message meta, whose copies
    of a body of several MiB took longer than the wire in a trial on shaped links. A token
    bucket that holds more than the larger probe (a 10gbit tbf link here, 2.5 MB) lets both pass
    at once: the rate then reads high, which only keeps no codec."""
    small, big = sizes
    best = {}
    for nbytes in (small, big) * repeats:   # interleaved: load drifts hit both
        elapsed = _timed(send, nbytes)
        best[nbytes] = min(best.get(nbytes, elapsed), elapsed)
    slope = best[big] - best[small]
    return float('inf') if slope <= 0 else num_servers * (big - small) / slope


def estimate(candidates, sizes, num_workers, num_servers, delay, rate, chunk_size, cpu):
    """``{name: (wire seconds, cpu seconds, estimated step seconds)}`` of each candidate.

    The wire: the busiest link, a server's (its share of every worker's pushes, and its
    pulls' every `delay` steps) or a worker's, at `rate` bytes per second. The CPU:
    ``cpu(candidate)`` seconds, weighted by :data:`CPU_WEIGHT` in the step."""
    share = max(float(num_workers) / num_servers, 1.0)
    table = {}
    for candidate in candidates:
        push, pull = wire_bytes(candidate, sizes, chunk_size, num_workers)
        wire = share * (push + pull / float(delay)) / rate
        seconds = cpu(candidate)
        table[candidate.name] = (wire, seconds, wire + CPU_WEIGHT * seconds)
    return table


def decide(table, allowed, margin=MARGIN):
    """The name of the candidate to use: the cheapest estimate in `table` among `allowed`
    (names; 'none' always is), but 'none' unless that beats 'none''s by `margin` (a tie or
    a near-tie keeps no codec)."""
    names = [c.name for c in CANDIDATES if c.name in allowed and c.name in table]
    best = min(names, key=lambda name: table[name][2])
    if best != 'none' and not table[best][2] <= margin * table['none'][2]:
        return 'none'
    return best


def pinned_arguments(candidate):
    """The trainer's arguments that pin `candidate` (for the log)."""
    return 'compression_params=%r, pull_compression=%r' % (candidate.push, candidate.pull)


def choose(request, optimizer_type, num_workers, num_servers, chunk_size, send_probe):
    """Rank 0's choice: measure, estimate, decide and log; return the :class:`Candidate`.

    Parameters
    ----------
    request : Request
    optimizer_type : str or None
        The optimizer's registry name (its support: :data:`SUPPORT`).
    num_workers, num_servers, chunk_size : int
    send_probe : callable
        ``send_probe(nbytes)``: one PROBE of `nbytes` to every server (:func:`probe_rate`).
    """
    kept = request.resumed()
    if kept is not None:
        # The checkpoint holds the state of these codecs (residuals, pulled models): another
        # choice would make its load refuse it, and the job would start over.
        chosen = next((c for c in CANDIDATES if (c.push, c.pull) == (
            kept['compression_params'], kept['pull_compression'])),
            Candidate('checkpoint', kept['compression_params'], kept['pull_compression']))
        _LOG.info('auto codec: keeps %s, the codecs of the checkpoint the job resumes from; '
                  'to repeat it pass %s', chosen.name, pinned_arguments(chosen))
        return chosen
    names, rows = supported(optimizer_type)
    restriction = request.restriction()
    if restriction:
        names, rows = ('none',), restriction
    sizes = [int(n) for n in request.sizes()]
    pinned = env.get_float('MXDELAY_AUTO_CODEC_LINK')
    rate = pinned / 8.0 if pinned is not None else probe_rate(send_probe, num_servers)
    candidates = [c for c in CANDIDATES if c.name in names]
    table = estimate(candidates, sizes, num_workers, num_servers, request.delay, rate,
                     chunk_size, lambda c: codec_seconds(c, sizes, num_workers, num_servers,
                                                         request.delay))
    chosen = next(c for c in CANDIDATES if c.name == decide(table, names))
    _LOG.info('auto codec: link %.3g Gbit/s (%s), %d trained elements in %d tensors, %d '
              'workers, %d servers, k=%d, optimizer %s: candidates %s (%s)',
              rate * 8e-9, 'MXDELAY_AUTO_CODEC_LINK' if pinned is not None else 'probed',
              sum(sizes), len(sizes), num_workers, num_servers, request.delay,
              optimizer_type, ', '.join(names), rows)
    for name, (wire, cpu, total) in sorted(table.items(), key=lambda item: item[1][2]):
        _LOG.info('auto codec: %-12s wire %8.2f ms + %.0f x codec CPU %7.2f ms = %8.2f ms a '
                  'step', name, 1e3 * wire, CPU_WEIGHT, 1e3 * cpu, 1e3 * total)
    _LOG.info('auto codec: chose %s (a codec only at <= %.2f of no codec\'s estimate); to '
              'repeat it pass %s', chosen.name, MARGIN, pinned_arguments(chosen))
    return chosen

