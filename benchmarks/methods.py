"""What the benchmarks run: every method and every link, declared once.

:data:`METHODS` holds every method of every benchmark (the trainer kind, delay, compression
and further worker arguments of ``bench_worker.py``; a stock baseline is ``--mode sync``), and
:data:`NETWORKS` every link a benchmark shapes (``benchmarks/netns.py``). A scenario takes the
methods it runs by name (:func:`methods`); a report names a folder's methods again from its
runs, so a method stays here as long as a committed results folder holds runs of it.
"""
import dataclasses
from typing import NamedTuple, Optional, Tuple

__all__ = ['Method', 'METHODS', 'TWO_BIT_THRESHOLD', 'methods', 'Network', 'NETWORKS']


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of ``bench_worker.py``: its label and what it runs; :attr:`args` are the
    worker arguments it implies.

    `warmup` is the number of synchronous warm-up steps of a delayed method's training runs,
    None for the script's own default (``tta.py``: 200). It is not in :attr:`args`: each
    script passes ``--warmup-steps`` itself (its short timing runs shorten the warm-up), and
    two methods that differ only in it run the same job per step (:attr:`job`).
    """
    label: str
    trainer: str = 'delayed'          # bench_worker's --mode: sync or delayed
    delay: Optional[object] = None    # k, or 'auto'
    extra: Tuple[str, ...] = ()       # further worker arguments (e.g. the local rule)
    compression: Optional[str] = None
    env: Tuple[Tuple[str, str], ...] = ()   # variables added to the job's environment
    warmup: Optional[int] = None      # warm-up steps of training runs; None: the script's

    def __post_init__(self):
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0
                                        or self.stock):
            raise ValueError('Method %r: warmup=%r; give a whole number of steps >= 0 for a '
                             'delayed method, or None for the script\'s default'
                             % (self.label, self.warmup))

    @property
    def args(self):
        """The worker arguments: mode, delay, `extra`, compression, in that order."""
        return (['--mode', self.trainer] + (['--delay', str(self.delay)] if self.delay else [])
                + list(self.extra)
                + (['--compression', self.compression] if self.compression else []))

    @property
    def stock(self):
        """Whether this is a stock baseline: no process of its job may import mxdelay."""
        return self.trainer == 'sync'

    @property
    def job(self):
        """What a step runs: worker arguments and environment (the warm-up's length and the
        label left out). Methods with equal jobs have the same per-phase step times."""
        return tuple(self.args), self.env


TWO_BIT_THRESHOLD = 0.5
_TWO_BIT = '2bit:%g' % TWO_BIT_THRESHOLD
_MIRROR = ('--local-rule', 'mirror')
_FROZEN = ('--freeze-second-moment',)
_BOUND_2M = (('MXNET_KVSTORE_BIGARRAY_BOUND', '2000000'),)
#: name -> Method: every method of every benchmark, declared once.
METHODS = {
    'sync': Method('dist_sync (stock)', trainer='sync'),
    'sync-2bit': Method('dist_sync + 2bit (stock)', trainer='sync', compression=_TWO_BIT),
    'k2': Method('k=2', delay=2),
    'k4': Method('k=4', delay=4),
    'k8': Method('k=8', delay=8),
    'k16': Method('k=16', delay=16),
    # delay='auto' (mxdelay.autodelay): k of {2, 4} or synchronous, chosen by worker 0's
    # measurements of the warm-up, with a measured fallback (docs/design.md §1.2).
    'auto': Method("delay='auto'", delay='auto'),
    'k4-fp16': Method('k=4 + fp16', delay=4, compression='fp16'),
    'k4-2bit': Method('k=4 + 2bit', delay=4, compression=_TWO_BIT),
    'mirror-k4': Method('k=4', delay=4, extra=_MIRROR),
    'mirror-k4-fp16': Method('k=4 + fp16', delay=4, extra=_MIRROR, compression='fp16'),
    'sgd-k4': Method("literal 'sgd' rule, k=4", delay=4, extra=('--local-rule', 'sgd')),
    # The global model with the workers' mean BatchNorm statistics (docs/design.md §2.13).
    'k4-aux': Method('k=4, mean BatchNorm statistics', delay=4, extra=('--aux-states',)),
    'k8-aux': Method('k=8, mean BatchNorm statistics', delay=8, extra=('--aux-states',)),
    'drift-k4': Method("rule 'drift', k=4", delay=4, extra=('--local-rule', 'drift')),
    'drift-k8': Method("rule 'drift', k=8", delay=8, extra=('--local-rule', 'drift')),
    'drift-k16': Method("rule 'drift', k=16", delay=16, extra=('--local-rule', 'drift')),
    # Compressed pulls (docs/design.md §2.12); 2bit at 0.05, the best fixed threshold for
    # SGD-momentum measured earlier (0.5, the stock default above, trained to 0.38).
    'k4-pull-fp16': Method('k=4 + pull fp16', delay=4, extra=('--pull-compression', 'fp16')),
    'k4-pull-int8': Method('k=4 + pull int8', delay=4, extra=('--pull-compression', 'int8')),
    'k4-2bit-pull-int8': Method('k=4 + 2bit 0.05 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='2bit:0.05'),
    # float16 pushes with int8 pulls: the fewest bytes of the exact-sum settings (§2.11).
    'k4-fp16-pull-int8': Method('k=4 + fp16 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='fp16'),
    # Blockwise quantized pushes with error feedback, one row per worker (§2.14), at the
    # default block of 256 values.
    'k4-int8': Method('k=4 + int8', delay=4, compression='int8'),
    'k4-int4': Method('k=4 + int4', delay=4, compression='int4'),
    'k4-ternary': Method('k=4 + ternary', delay=4, compression='ternary'),
    'k4-int8-pull-int8': Method('k=4 + int8 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='int8'),
    'k4-int4-pull-int8': Method('k=4 + int4 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='int4'),
    'k4-ternary-pull-int8': Method('k=4 + ternary + pull int8', delay=4,
                                   extra=('--pull-compression', 'int8'), compression='ternary'),
    # Both chosen by the job: the codecs at the hand-shake (compression_params='auto',
    # docs/design.md §2.16), k at the switch (delay='auto', §1.2).
    'auto-auto': Method("delay='auto' + compression 'auto'", delay='auto', compression='auto'),
    'auto-ternary-pull-int8': Method("delay='auto' + ternary + pull int8", delay='auto',
                                     extra=('--pull-compression', 'int8'),
                                     compression='ternary'),
    'k8-ternary-pull-int8': Method('k=8 + ternary + pull int8', delay=8,
                                   extra=('--pull-compression', 'int8'), compression='ternary'),
    'k8-fp16-pull-int8': Method('k=8 + fp16 + pull int8', delay=8,
                                extra=('--pull-compression', 'int8'), compression='fp16'),
    # Adam with its second moment frozen at the switch (mxdelay.FrozenVarianceAdam, §1.4).
    'k4-fv': Method('k=4, v frozen', delay=4, extra=_FROZEN),
    'k8-fv': Method('k=8, v frozen', delay=8, extra=_FROZEN),
    'k16-fv': Method('k=16, v frozen', delay=16, extra=_FROZEN),
    'k4-ternary-pull-int8-fv': Method('k=4 + ternary + pull int8, v frozen', delay=4,
                                      extra=('--pull-compression', 'int8') + _FROZEN,
                                      compression='ternary'),
    # Whole-tensor optimizers (LAMB) on the MLP, whose 1024 x 1024 weight reaches MXNet's
    # default bound of a million elements: mxdelay keeps tensors whole only below it.
    'k4-bound2m': Method('k=4, bound 2M', delay=4, env=_BOUND_2M),
    'k8-bound2m': Method('k=8, bound 2M', delay=8, env=_BOUND_2M),
}
# The same with shorter warm-ups (issue 20: the shortest warm-up that keeps accuracy).
for _name, _label in (('k4-fp16-pull-int8', 'k=4 + fp16 + pull int8'),
                      ('k8-fp16-pull-int8', 'k=8 + fp16 + pull int8'),
                      ('k4-ternary-pull-int8', 'k=4 + ternary + pull int8')):
    for _w in (0, 50, 100):
        METHODS['%s-w%d' % (_name, _w)] = dataclasses.replace(
            METHODS[_name], warmup=_w, label='%s, warm-up %d' % (_label, _w))
del _name, _label, _w
# The same evaluated as the global model: every worker calls sync_weights() at each
# evaluation (tta.py otherwise evaluates worker 0's own weights, a pull plus up to k local
# steps).
for _name in ('k4', 'k4-ternary-pull-int8'):
    METHODS[_name + '-gm'] = dataclasses.replace(
        METHODS[_name], extra=METHODS[_name].extra + ('--global-model',),
        label=METHODS[_name].label + ', global model')
del _name
# Stock dist_sync with MXNet's 2bit at thresholds below its documented 0.5 (which does not
# train the MLP): the search for stock's best threshold (issue 20).
for _t in ('0.1', '0.05', '0.02', '0.01', '0.005', '0.002'):
    METHODS['sync-2bit-' + _t] = Method('dist_sync + 2bit %s (stock)' % _t, trainer='sync',
                                        compression='2bit:' + _t)
del _t


def methods(*names):
    """``{name: Method}`` of `names`, in order; ``'name=registry-name'`` takes a registry
    method under another name, e.g. ``methods('sync', 'k4=mirror-k4')``."""
    chosen = {}
    for name in names:
        name, _, source = name.partition('=')
        chosen[name] = METHODS[source or name]
    return chosen


class Network(NamedTuple):
    """One network of the benchmarks: label and ``tc`` rate (None: loopback)."""
    label: str
    rate: Optional[str] = None


#: name -> Network: every link the benchmarks shape (benchmarks/netns.py).
NETWORKS = {
    'loopback': Network('loopback'),
    '1gbit': Network('1 Gbit/s links', '1gbit'),
    '100mbit': Network('100 Mbit/s links', '100mbit'),
}
