"""``mxdelay-launch --max-restarts N``: run the job again after a failure, up to N times.

Each attempt is a whole :class:`~mxdelay.launching.job.Job`: the first process that fails
ends it as always (every role stopped, nothing left behind); then, after a back-off, every
role starts again, with a fresh scheduler port unless ``--port`` chose one. The job resumes
from the newest complete checkpoint of ``--checkpoint-dir`` (the workers' trainers load it,
:mod:`mxdelay.autosave`); the launcher says which, or that there is none and the job starts
over. What ends the launcher instead of an attempt: every worker done (exit 0), a failure
once the restarts are used up (its exit code), ``--timeout`` (which bounds all attempts
together: 124), a start that fails (127), or SIGINT, SIGTERM or SIGHUP (130, 143, 129), also
during the back-off.
"""
import logging
import signal
import time

from mxdelay import checkpoint_dir
from .job import EXIT_TIMEOUT, Job
from .options import free_port

__all__ = ['run', 'backoff', 'BACKOFF_FIRST', 'BACKOFF_MAX', 'STABLE_SECONDS']

_LOG = logging.getLogger('mxdelay.launcher')

#: Seconds before the first restart; each further restart waits twice as long as the one
#: before, up to :data:`BACKOFF_MAX`, unless the attempt that failed ran :data:`STABLE_SECONDS`
#: or more (then it waits BACKOFF_FIRST again): a job that fails at once is not restarted
#: in a tight loop, one that fails now and then restarts quickly each time.
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
STABLE_SECONDS = 30.0

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_SECONDS = 0.05


def backoff(previous, ran):
    """Seconds to wait before a restart, after a back-off of `previous` seconds (None before
    the first restart) and an attempt that ran `ran` seconds."""
    if previous is None or ran >= STABLE_SECONDS:
        return BACKOFF_FIRST
    return min(2 * previous, BACKOFF_MAX)


class _StopSignals:
    """SIGINT, SIGTERM and SIGHUP, recorded (the first one) while the launcher runs."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        self._previous = {signum: signal.signal(signum, self._on_signal)
                          for signum in _STOP_SIGNALS}
        return self

    def __exit__(self, *_):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, _frame):
        self.signum = self.signum or signum

    def received(self):
        """The first stop signal received, or None."""
        return self.signum


def run(config):
    """Run the job of `config`, again after each failure up to ``config.max_restarts`` times.

    Returns
    -------
    int
        The launcher's exit code: 0 when every worker exited 0 in some attempt, else that
        of the last attempt's ending.
    """
    deadline = time.monotonic() + config.timeout if config.timeout else None
    failures = []   # (attempt, seconds it ran, what failed)
    wait = None
    with _StopSignals() as signals:
        while True:
            attempt = len(failures) + 1
            # The first attempt's port was checked with the options; a later one gets a new
            # free port (or --port's again): the old one may still be closing.
            port = config.port if attempt == 1 or config.port_given else free_port()
            started = time.monotonic()
            ending = Job(config, port).run(signals.received, deadline)
            ran = time.monotonic() - started
            if ending.failure is None:
                if failures and ending.code == 0:
                    _LOG.warning('the job finished in attempt %d, after surviving %d failure(s): '
                                 '%s', attempt, len(failures), _listed(failures))
                return ending.code
            failures.append((attempt, ran, ending.failure))
            if len(failures) > config.max_restarts:
                if config.max_restarts:
                    _LOG.error('giving up: attempt %d of %d failed (--max-restarts %d); the '
                               'failures: %s', attempt, attempt, config.max_restarts,
                               _listed(failures))
                return ending.code
            wait = backoff(wait, ran)
            _LOG.warning('attempt %d of at most %d ended after %.1f s: %s; starting every role '
                         'again in %g s (restart %d of %d); %s', attempt,
                         config.max_restarts + 1, ran, ending.failure, wait, attempt,
                         config.max_restarts, _resumes_from(config.checkpoint_dir))
            code = _sleep(wait, signals, deadline, config.timeout)
            if code is not None:
                return code
            _LOG.warning('attempt %d of at most %d', attempt + 1, config.max_restarts + 1)


def _listed(failures):
    return '; '.join('attempt %d after %.1f s: %s' % failure for failure in failures)


def _resumes_from(directory):
    """Where the next attempt resumes, in words."""
    if directory is None:
        return ('no --checkpoint-dir: the job starts over, unless its script resumes by '
                'itself')
    newest = checkpoint_dir.newest_complete(directory)
    if newest is None:
        return 'no complete checkpoint in %s yet: the job starts over' % directory
    return 'the workers resume from the checkpoint of step %d (%s)' % newest


def _sleep(seconds, signals, deadline, timeout):
    """Wait `seconds`; return an exit code if a stop signal or ``--timeout`` came first."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if signals.received() is not None:
            _LOG.error('received %s during the back-off; stopping',
                       signal.Signals(signals.received()).name)
            return 128 + signals.received()
        if deadline is not None and time.monotonic() > deadline:
            _LOG.error('the job ran longer than --timeout %g s; not restarting it', timeout)
            return EXIT_TIMEOUT
        time.sleep(_POLL_SECONDS)
    return None
