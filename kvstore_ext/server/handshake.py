"""The hand-shake: every worker's ``hello``, checked, and what the hand-shake round answers.

Each worker's first command is ``hello`` (docs/design.md §4.3). The first hello that passes
its checks fixes the job's key layout (:class:`kvstore_ext.protocol.keys.KeyLayout`); the
hellos are answered together, when the workers' round of the status key completes: refused
if they disagree (:func:`kvstore_ext.server.agreement.hello_refusal`) or speak another
protocol version, else accepted with the job's ``rescale_grad``.
"""
from kvstore_ext import env
from kvstore_ext.codecs import pulls
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import check_rank, field
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.protocol.schedule import PullSchedule
from kvstore_ext.server import agreement

__all__ = ['Handshake']

#: The most slots, state keys or pull keys per chunk a hello may ask for (MXDELAY_SLACK is
#: at most 256): a bound, so that a forged hello cannot make the layout absurd.
_MAX_KEYS_PER_CHUNK = 1024


class Handshake(object):
    """One server's side of the hand-shake.

    Parameters
    ----------
    job : kvstore_ext.server.job.Job
    rounds : kvstore_ext.server.rounds.RoundKeeper
        Told the slot count (first hello) and, when the hand-shake succeeds, AMP's skipping
        of overflowed rounds and the compressed pulls' codec and schedule.
    on_layout : callable
        Called as ``on_layout(layout)`` once, when the first hello fixes the key layout.
    """

    def __init__(self, job, rounds, on_layout):
        self._job = job
        self._rounds = rounds
        self._on_layout = on_layout
        self._hellos = {}              # worker rank -> hello body
        # A hello of another protocol version: what the hand-shake round tells every worker
        # (that worker's own command reply may find no status key to be written into yet).
        self._version_refusal = None
        #: The job's KeyLayout, from the first good hello (None before).
        self.layout = None

    def hello(self, body):
        """The ``hello`` command: check `body` and keep it. Returns None: the hellos are
        answered when the hand-shake round completes (:meth:`status_round`)."""
        if body.get('protocol') != commands.PROTOCOL_VERSION:
            self._version_refusal = (
                'worker %.20r speaks protocol %.20r, server %s speaks %d: install the same '
                'mxdelay version everywhere' % (body.get('rank'), body.get('protocol'),
                                                self._job.server_rank,
                                                commands.PROTOCOL_VERSION))
            raise ValueError(self._version_refusal)
        rank = self._check(body)
        num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        # compression_params='auto' (docs/design.md §2.16): rank 0 chose the codecs, which
        # fix the layout; the others' hellos wait for its (every round of the job, the
        # hand-shake's included, follows rank 0's hello: its init's barrier).
        if self.layout is None and (rank == 0 or not body['config'].get('auto_codec')):
            slots = body['slots']
            # float16 or blockwise pushes: P pull keys per chunk, which hold W (R, or 1 with
            # compressed pulls, docs/design.md §2.11)
            self.layout = KeyLayout(num_servers, slots, body.get('state_keys', 0),
                                    pull_keys=body.get('pull_keys', 0),
                                    model_keys=body.get('model_keys', 0))
            self._rounds.set_slots(self.layout.slots)
            self._rounds.pulls.set_count(self.layout.pull_keys)
            self._on_layout(self.layout)
        self._hellos[rank] = body

    def _check(self, body):
        """The hello's rank, once every field is checked: one hello per rank (ps-lite does
        not tell the controller who sent a command, docs/design.md §4.1)."""
        num_workers = self._job.num_workers
        rank = check_rank(body, num_workers)
        if rank in self._hellos:
            raise ValueError('worker rank %d said hello twice: a second process claims rank %d '
                             '(only one hello per rank is taken)' % (rank, rank))
        if field(body, 'num_workers', int, optional=True, default=num_workers) != num_workers:
            raise ValueError('command field \'num_workers\' is %d, this job has %d workers'
                             % (body['num_workers'], num_workers))
        field(body, 'slots', int, minimum=1, maximum=_MAX_KEYS_PER_CHUNK)
        field(body, 'state_keys', int, minimum=0, maximum=_MAX_KEYS_PER_CHUNK, optional=True)
        field(body, 'pull_keys', int, minimum=0, maximum=_MAX_KEYS_PER_CHUNK, optional=True)
        field(body, 'model_keys', int, minimum=0, maximum=1, optional=True)
        field(body, 'launcher_rank', str, optional=True)
        config = field(body, 'config', dict)
        field(config, 'optimizer', dict, optional=True)
        field(config, 'auto_codec', bool, optional=True)
        return rank

    def reply(self):
        """``(ok, payload)``: what the hand-shake round answers every worker now (§4.3); on
        success it fixes the job's rescale_grad and AMP's skipping of overflowed rounds."""
        job = self._job
        refusal = self._version_refusal or agreement.hello_refusal(
            self._hellos, job.num_workers, job.server_rank)
        if refusal is not None:
            return False, refusal
        config = self._hellos[0]['config']
        # One rescale_grad for the whole job, rank 0's (1/its first batch size): every worker
        # scales its own gradient relative to it (kvstore_ext.worker.rounds, scale_gradients),
        # so that workers with other or changing batch sizes need no command and cannot
        # rescale each other.
        optimizer = config.get('optimizer')
        job.rescale_grad = optimizer.get('rescale_grad') if optimizer else None
        # DelayedTrainer with AMP divides an overflowed round's pushes by 0: skip such
        # rounds (docs/design.md §11). Off otherwise: stock dist_sync applies them.
        self._rounds.updates.set_skip_nonfinite(config.get('amp'))
        # Compressed pulls (docs/design.md §2.12): the servers write each pulled round's
        # payload when they apply it, so they must know which rounds are pulled.
        pull_setting = config.get('pull_compression')
        if pull_setting is not None:
            self._rounds.models.set_codec(pulls.parse(pull_setting), PullSchedule(
                config['delay'], config['warmup_steps']))
        payload = {'server': job.server_rank, 'protocol': commands.PROTOCOL_VERSION,
                   'num_workers': job.num_workers, 'rescale_grad': job.rescale_grad}
        if config.get('auto_codec'):   # rank 0's choice, for the other workers
            payload['codec'] = {'compression': config.get('compression'),
                                'pull_compression': pull_setting}
        return True, payload

    def status_round(self, stored):
        """The workers' round of the status key `stored` completed: it is this server's
        status key from now on, and carries the hand-shake's reply to every worker."""
        self._job.status = stored
        ok, payload = self.reply()
        self._job.reply_all(ok, payload)

    def refused_round(self, key, stored):
        """Before any layout: if `key`'s round is the hand-shake round of workers of another
        protocol version (their hello set up no layout), refuse them in `stored` rather than
        answer them as a stock server would, and return True."""
        refusal, num_workers = self._version_refusal, self._job.num_workers
        if refusal is None or key // self.num_servers() != 0 \
                or stored.size != commands.reply_len(num_workers) * num_workers:
            return False
        self._job.status = stored
        self._job.reply_all(False, refusal)
        return True

    def num_servers(self):
        """The job's number of servers: the layout's, else this server's environment's."""
        if self.layout is not None:
            return self.layout.num_servers
        return env.get_int('DMLC_NUM_SERVER') or 1

    def chunk_size(self):
        """The workers' ``MXDELAY_CHUNK_SIZE`` (from the hellos heard; None before any)."""
        hello = self._hellos.get(0) or next(iter(self._hellos.values()), {})
        return hello.get('config', {}).get('chunk_size')
