"""What ``benchmarks/tta.py`` runs, shared by its runs and its report (``tta_report.py``,
``tta_page.py``): the methods, the networks, the optimizers, the warm-ups and the job's shape."""
import harness

__all__ = ['COMMAND', 'TRAIN_IMAGES', 'METHODS', 'DEFAULT_METHODS', 'NETWORKS', 'FULL_WARMUP',
           'OPTIMIZERS', 'steps_per_epoch', 'eval_every', 'known_method', 'job_of', 'is_stock',
           'warmup_of', 'job_shape']

COMMAND = 'python benchmarks/tta.py'   # what the results files record as the command's start
BATCH = harness.BATCH
TRAIN_IMAGES = 60000
METHODS = harness.methods('sync', 'k2', 'k4', 'k8', 'drift-k4', 'drift-k8')
#: What --methods runs unless told (the drift rule's runs are asked for by name).
DEFAULT_METHODS = ('sync', 'k2', 'k4', 'k8')
#: network -> (label, tc rate or None, phase-run warm-up steps, delayed steps, s/step bound)
NETWORKS = {name: harness.NETWORKS[name][:2] + steps for name, steps in (
    ('loopback', (100, 304, 1.0)), ('1gbit', (40, 80, 2.0)), ('100mbit', (12, 32, 10.0)))}
FULL_WARMUP = 200      # the default of DelayedTrainer and of the example
#: --optimizer -> (label, bench_worker arguments): the servers' optimizer of every method.
#: LAMB's rate: the best of 0.002, 0.005, 0.01, 0.02 in a 2-epoch single-process pilot of
#: gluon.Trainer at batch 256 (0.8715 after 2 epochs; 0.02 fell to 0.80).
OPTIMIZERS = {
    'sgd': ('SGD (lr 0.05, momentum 0.9)', []),
    'lamb': ('LAMB (lr 0.005, wd 0)', ['--optimizer', 'lamb', '--lr', '0.005', '--wd', '0']),
    'adam': ('Adam (lr 1e-3, wd 0)', ['--optimizer', 'adam', '--lr', '0.001', '--wd', '0']),
}


def steps_per_epoch(workers):
    """Steps of an epoch with `workers` workers (bench_worker's shards: whole batches)."""
    return TRAIN_IMAGES // (BATCH * workers)


def eval_every(workers):
    """Steps between worker 0's kept weights: a third of an epoch (78 with 2 workers)."""
    return steps_per_epoch(workers) // 3


def known_method(name):
    """Whether `name` is a method here; any method of harness.METHODS becomes one (report:
    a folder's runs name their methods again)."""
    if name not in METHODS and name in harness.METHODS:
        METHODS.update(harness.methods(name))
    return name in METHODS


def job_of(meta):
    """``(workers, servers, optimizer)`` that a part's meta file records (files from before
    ``--workers`` and ``--optimizer``: 2, 1, ``'sgd'``)."""
    settings = meta.get('settings', {})
    return (settings.get('workers', harness.NUM_WORKERS), settings.get('servers', 1),
            settings.get('optimizer', 'sgd'))


def is_stock(method):
    """Whether `method` is a stock baseline (bench_worker's ``--mode sync``: no mxdelay)."""
    return METHODS[method].stock


def warmup_of(method):
    """The warm-up steps of `method`'s full runs: its own (:attr:`harness.Method.warmup`), or
    FULL_WARMUP."""
    warmup = METHODS[method].warmup
    return FULL_WARMUP if warmup is None else warmup


def job_shape(metas):
    """``(workers, servers)`` of the folder's runs (meta files before ``--workers``: 2, 1)."""
    shapes = {job_of(m)[:2] for m in metas.values() if 'settings' in m}
    if len(shapes) > 1:
        raise ValueError('the parts of this folder ran different jobs (workers, servers): %s; '
                         'give each job its own --out' % sorted(shapes))
    return list(shapes.pop()) if shapes else [harness.NUM_WORKERS, 1]
