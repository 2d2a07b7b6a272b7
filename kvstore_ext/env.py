"""Every environment variable mxdelay reads, read here and nowhere else.

docs/env.md's table documents each entry of :data:`VARIABLES`; :func:`markdown_table`
writes it and tests/test_env.py checks that it is current.
This module imports nothing (neither MXNet nor :mod:`mxdelay`): the role dispatch
(:mod:`kvstore_ext.bootstrap`) and the launcher read it before MXNet may be imported.
"""
import logging
import math
import os

__all__ = ['VARIABLES', 'MXNET_DEFAULTS', 'MINIMUMS', 'CHOICES', 'get', 'get_int', 'get_float',
           'get_bool', 'get_choice', 'get_list', 'role', 'log_level', 'job_key',
           'set_mxnet_defaults', 'mxnet_defaults_applied', 'markdown_table']

#: name -> (default, one-line meaning). docs/env.md's table is generated from this.
VARIABLES = {
    'DMLC_ROLE': (None, "Role of this process ('scheduler', 'server', 'worker'); set by the launcher."),
    'DMLC_NUM_WORKER': (None, 'Number of workers in the job (at least 1); set by the launcher.'),
    'DMLC_NUM_SERVER': (None, 'Number of servers in the job (at least 1; 0 is refused, not '
                              'taken for 1); set by the launcher.'),
    'MXDELAY_CHUNK_SIZE': ('524288', 'Largest number of elements in one kvstore key; larger tensors '
                                     'are split into chunks that spread over the servers.'),
    'MXDELAY_SLACK': ('1', "Default slack of a 'dist_delay' kvstore in rounds, 1 to 256 (a worker may "
                           'run this many rounds ahead of the slowest); DelayedTrainer raises it to '
                           'at least delay.'),
    'MXDELAY_LOG_LEVEL': ('INFO', 'Log level of mxdelay server processes and of mxdelay-launch: '
                                  'DEBUG, INFO, WARNING, ERROR or CRITICAL (any case); another '
                                  'value is refused.'),
    'MXDELAY_RANK': (None, 'Rank of this process within its role; set by mxdelay-launch for log prefixes.'),
    'MXDELAY_LOCAL_RANK': (None, "A worker's index among the workers on its host (0 first); set by "
                                 'mxdelay-launch; mxdelay.local_rank() reads it (0 when unset), '
                                 'e.g. for mx.gpu(local_rank % GPUs).'),
    'MXDELAY_LOCAL_SIZE': (None, 'Number of workers on this worker\'s host; set by mxdelay-launch; '
                                 'mxdelay.local_size() reads it (1 when unset).'),
    # Why 4 (docs/benchmarks/overlap/overlap.md, per-layer pushes): on 1 Gbit/s links 15 is faster
    # in the synchronous warm-up (520 vs 554 ms/step: all gradients ready at once, sent
    # first layer first) and ties in the delayed phase (331 vs 331); on loopback 4 is
    # faster (64.5 vs 68.9, 52.4 vs 54.1); 1 is the slowest on the link; and 4, unlike 15,
    # lets pushes overlap backward.
    'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD': (
        '4', "MXNet's backward bulk size. MXNet's default (15) runs a small network's whole "
             'backward as one engine operation, so no push can start before backward ends; '
             '`import mxdelay` (before mxnet) sets 4 when unset: every few operators end a '
             'segment and their gradients are pushed while backward goes on.'),
    'MXNET_KVSTORE_BIGARRAY_BOUND': (
        '1000000', "MXNet's: keys of at least this many elements are split over all servers. "
                   'mxdelay keeps every key below it (chunks, status keys); set it alike on '
                   'every worker and server.'),
    'MXDELAY_ALLOW_PICKLE': ('0', "Servers only: '1' lets a server unpickle what a command "
                                  "brings it: a stock MXNet worker's optimizer (a stock "
                                  "dist_sync script under mxdelay-run) and version-1 "
                                  'server files of load_states(..., trusted=True). Otherwise '
                                  'both are refused with an error (unpickling runs code).'),
    'MXDELAY_CODEC_KERNELS': ('auto', "How the codecs run: 'auto' (the C kernels, built once per machine "
                                      "into ~/.cache/mxdelay with the system's C compiler; numpy, "
                                      "with a warning, where none builds), 'compiled' (the C "
                                      "kernels or an error) or 'numpy'. Every choice computes the "
                                      'same bits.'),
    'MXDELAY_JOB_KEY': (None, "A secret shared by every process of one job: each mxdelay command "
                              'carries an HMAC-SHA256 of its text with this key, and servers '
                              'refuse a command without a valid one. mxdelay-launch makes a '
                              'random key per job; with another launcher set the same value on '
                              'every process (e.g. `openssl rand -hex 32`). Unset on the '
                              'servers: commands are not authenticated (logged once). It '
                              "protects mxdelay's commands, not ps-lite's data messages."),
    'MXDELAY_UPDATER_ERRORS': ('stop', "Servers only: what a server does when the optimizer's "
                                       "update raises. 'stop': it ends the job (exit code 3) "
                                       'with the error, naming the optimizer, the parameter '
                                       "and the round; 'log': it logs the error and goes on, "
                                       "as MXNet's own server does (that round's weights stay "
                                       'as far as the update got).'),
    'MXDELAY_SERVER_IMPORTS': (None, 'Servers only: modules (comma-separated) a server imports '
                                     'before it serves, e.g. the one that registers a '
                                     'user-defined optimizer with @mx.optimizer.register: a '
                                     'server runs none of the training script. They must be '
                                     "importable from the servers' PYTHONPATH."),
    'MXDELAY_TIMELINE': (None, 'Path prefix: every DelayedTrainer records MXDELAY_TIMELINE_STEPS steps, '
                               'from its second (the first sends the initial weights), with MXNet\'s profiler into PREFIX.rank<i>.json (i: the '
                               "trainer's rank); read them with python -m mxdelay.trace. Unset: off."),
    'MXDELAY_AUTO_CODEC_LINK': (None, "Tests and benchmarks: a link rate in bit/s (e.g. 1e9) that "
                                      "compression_params='auto' takes instead of probing the "
                                      'link to the servers (rank 0 reads it; the codecs\' CPU is '
                                      'still measured). Unset: probed.'),
    'MXDELAY_TIMELINE_STEPS': ('20', 'Steps that MXDELAY_TIMELINE records (an integer >= 1).'),
    'MXDELAY_LOG_EVERY': ('0', 'N: every DelayedTrainer logs (INFO) a line every N steps: '
                               'samples/s, the share of the time spent waiting for '
                               'communication, bytes sent and received per step '
                               '(mxdelay.steplog says how each is measured). 0: off.'),
    'MXDELAY_AUTO_DELAY_FORCE': ('measure', "Tests only: what delay='auto' decides on worker 0, "
                                            "whatever it measured: 'measure' (the default: "
                                            "decide by the measurements), 'stay' (synchronous "
                                            "from the switch on), '2' or '4' (that k, no "
                                            "fallback), '4-fallback' (k=4, then synchronous "
                                            'from the fallback check on). mxdelay.autodelay.'),
    'MXDELAY_SHUTDOWN_WAIT': ('30', 'Seconds mxdelay-launch lets the servers and the scheduler take to '
                                    'exit by themselves once every worker has exited 0, then it kills '
                                    'them: a finite number >= 0.'),
    'MXDELAY_CHECKPOINT_DIR': (None, 'Folder of the periodic checkpoints of every DelayedTrainer '
                                     '(its checkpoint_dir argument wins): it saves one every '
                                     'MXDELAY_CHECKPOINT_EVERY steps (where the job waits for '
                                     'the servers anyway, at most delay steps later) and '
                                     'resumes from the newest complete one; mxdelay-launch '
                                     '--checkpoint-dir sets it. Unset: off.'),
    'MXDELAY_CHECKPOINT_EVERY': (None, 'Steps between two periodic checkpoints (an integer >= 1; '
                                       'needed with MXDELAY_CHECKPOINT_DIR); mxdelay-launch '
                                       '--checkpoint-every sets it.'),
    'MXDELAY_KEEP_CHECKPOINTS': ('2', 'Periodic checkpoints kept, the newest complete ones (an '
                                      'integer >= 1); mxdelay-launch --keep-checkpoints sets it.'),
}

#: name -> (smallest valid value, what it is) of the numeric variables: a value below it is
#: refused where it is read, never replaced by a default (``DMLC_NUM_SERVER=0`` is not 1).
MINIMUMS = {
    'DMLC_NUM_WORKER': (1, 'the number of worker processes; launch with mxdelay-launch -n N, '
                           'which sets it'),
    'DMLC_NUM_SERVER': (1, 'the number of server processes, and a parameter-server job needs '
                           'one; launch with mxdelay-launch -s S, which sets it'),
    'MXDELAY_CHUNK_SIZE': (1, 'elements per key'),
    'MXDELAY_SLACK': (1, 'rounds a worker may run ahead of the slowest'),
    'MXDELAY_RANK': (0, "an index within the role; mxdelay-launch sets it"),
    'MXDELAY_LOCAL_RANK': (0, 'an index among the workers of one host; mxdelay-launch sets it'),
    'MXDELAY_LOCAL_SIZE': (1, 'the number of workers on this host; mxdelay-launch sets it'),
    'MXNET_KVSTORE_BIGARRAY_BOUND': (1, 'elements'),
    'MXDELAY_TIMELINE_STEPS': (1, 'steps to record'),
    'MXDELAY_AUTO_CODEC_LINK': (1, 'bits per second of the link'),
    'MXDELAY_LOG_EVERY': (0, 'steps between two log lines; 0 is off'),
    'MXDELAY_CHECKPOINT_EVERY': (1, 'steps between two checkpoints'),
    'MXDELAY_KEEP_CHECKPOINTS': (1, 'checkpoints to keep'),
    'MXDELAY_SHUTDOWN_WAIT': (0, 'seconds; 0 kills the servers as soon as the workers are done'),
}

#: name -> the values a variable may take (lower case; any case is accepted).
CHOICES = {'MXDELAY_UPDATER_ERRORS': ('stop', 'log'),
           'MXDELAY_AUTO_DELAY_FORCE': ('measure', 'stay', '2', '4', '4-fallback'),
           'MXDELAY_CODEC_KERNELS': ('auto', 'compiled', 'numpy')}

#: MXNet's variables that mxdelay gives its own default (before MXNet is imported).
MXNET_DEFAULTS = ('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD',)


def get(name):
    """Return the value of environment variable `name`, or its documented default."""
    if name not in VARIABLES:
        raise KeyError('%s is not an mxdelay environment variable; add it to env.VARIABLES '
                       '(docs/env.md\'s table is generated from it)' % name)
    return os.environ.get(name, VARIABLES[name][0])


def _parse(name, kind, convert):
    raw = get(name)
    if raw is None:
        return None
    default = VARIABLES[name][0]
    fix = 'unset it or set e.g. %s=%s' % (name, default) if default is not None else ''
    try:
        value = convert(raw)
    except ValueError:
        raise ValueError('environment variable %s=%r is not a valid %s; %s'
                         % (name, raw, kind, fix)) from None
    minimum, meaning = MINIMUMS.get(name, (None, ''))
    infinite = isinstance(value, float) and not math.isfinite(value)  # nan, inf
    if infinite or (minimum is not None and value < minimum):
        raise ValueError('environment variable %s=%r must be %s%s%s%s'
                         % (name, raw, 'an integer' if kind == 'integer' else 'a finite number',
                            '' if minimum is None else ' >= %s' % minimum,
                            ' (%s)' % meaning if meaning else '', '; ' + fix if fix else ''))
    return value


def get_int(name):
    """Return environment variable `name` as an int, or None if it is unset with no default.

    Raises
    ------
    ValueError
        Naming the variable, its value and the fix, if the value is not an integer or is
        below its minimum (:data:`MINIMUMS`).
    """
    return _parse(name, 'integer', int)


def get_float(name):
    """Return environment variable `name` as a float, or None if it is unset with no default.

    Raises
    ------
    ValueError
        Naming the variable, its value and the fix, if the value is not a number, is NaN or
        infinite, or is below its minimum (:data:`MINIMUMS`).
    """
    return _parse(name, 'number', float)


def get_bool(name):
    """Return environment variable `name` as a bool ('1', 'true', 'yes', 'on' are true)."""
    raw = get(name)
    return raw is not None and raw.strip().lower() in ('1', 'true', 'yes', 'on')


def get_choice(name):
    """Return environment variable `name`, one of :data:`CHOICES`, in lower case.

    Raises
    ------
    ValueError
        Naming the variable, its value and the values allowed, for any other value.
    """
    raw = get(name)
    value = raw.strip().lower()
    if value not in CHOICES[name]:
        raise ValueError('environment variable %s=%r is not one of %s; unset it (%s) or set '
                         'one of them' % (name, raw, ', '.join(CHOICES[name]), VARIABLES[name][0]))
    return value


def get_list(name):
    """Return environment variable `name` as a list of its comma-separated items, stripped
    (empty items dropped; an empty list when unset)."""
    return [item.strip() for item in (get(name) or '').split(',') if item.strip()]


def role():
    """Return this process's DMLC role, or None outside a distributed job."""
    value = get('DMLC_ROLE')
    return value.strip().lower() if value else None


def log_level():
    """Return ``MXDELAY_LOG_LEVEL`` as a :mod:`logging` level (mxdelay-launch and servers).

    Raises
    ------
    ValueError
        If it is not a level name of :mod:`logging` (case does not matter).
    """
    raw = get('MXDELAY_LOG_LEVEL')
    level = logging.getLevelName(raw.strip().upper())
    if not isinstance(level, int):  # getLevelName returns 'Level X' for an unknown name
        raise ValueError('environment variable MXDELAY_LOG_LEVEL=%r is not a log level; use '
                         'DEBUG, INFO, WARNING or ERROR, or unset it (INFO)' % raw)
    return level


def job_key():
    """Return ``MXDELAY_JOB_KEY`` as bytes, or None when it is unset or empty."""
    raw = get('MXDELAY_JOB_KEY')
    return raw.encode('utf-8') if raw else None


def set_mxnet_defaults():
    """Give MXNet mxdelay's defaults (:data:`MXNET_DEFAULTS`) for variables the user has not
    set. Called by :mod:`kvstore_ext.bootstrap` just before MXNet is imported (MXNet reads
    them once), never in a process that does not import MXNet."""
    for name in MXNET_DEFAULTS:
        os.environ.setdefault(name, VARIABLES[name][0])


def mxnet_defaults_applied():
    """Whether every variable of :data:`MXNET_DEFAULTS` is set in this process."""
    return all(name in os.environ for name in MXNET_DEFAULTS)


def markdown_table():
    """The Markdown table of :data:`VARIABLES` (name, default, meaning) that docs/env.md holds.

    Returns
    -------
    str
        Its lines, without a final newline.
    """
    lines = ['| variable | default | meaning |', '|---|---|---|']
    for name, (default, meaning) in VARIABLES.items():
        lines.append('| `%s` | %s | %s |' % (name, '-' if default is None else '`%s`' % default,
                                             meaning))
    return '\n'.join(lines)
