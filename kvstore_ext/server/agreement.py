"""What a server checks the workers agree on: the hand-shake's settings, the optimizer, a
checkpoint's optimizer, and the outcome of a collective step (docs/design.md §4.3, §4.4).

The messages name the setting, both values and both workers (with mxdelay-launch's worker
numbers, which may differ from ps-lite's ranks).
"""
import mxnet as mx

from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import field
from kvstore_ext.optim.optimizers import (PER_STEP_FIELDS, describe_optimizer,
                                          optimizer_differences, format_differences,
                                          type_difference)

__all__ = ['hello_refusal', 'optimizer_mismatch', 'saved_optimizer_differences', 'Ballots']

_MAX_ERROR = 600   # characters of one worker's error message in a tally


def _launcher_rank(hello):
    rank = hello.get('launcher_rank')
    return '' if rank is None else " (mxdelay-launch's worker %s)" % rank


def optimizer_mismatch(differences, first_name, second_name):
    """The refusal of workers whose optimizers differ (``optimizer_differences``)."""
    return ('workers disagree on the optimizer: %s. Every worker must create the same '
            'optimizer (type and hyper-parameters): the servers apply one optimizer to the '
            'sum of all workers\' gradients' % format_differences(
                differences, first_name, second_name))


def hello_refusal(hellos, num_workers, server_rank):
    """Why the hand-shake fails, or None.

    Parameters
    ----------
    hellos : dict
        Worker rank -> its ``hello`` body.
    num_workers : int
    server_rank : int
        This server's, for the message.
    """
    reference = hellos.get(0)
    if len(hellos) != num_workers or reference is None:
        return ('server %d heard hellos from workers %s, expected ranks 0..%d'
                % (server_rank, sorted(hellos), num_workers - 1))
    # compression_params='auto': rank 0 chose the codecs, the others take its choice.
    chosen = ('compression', 'pull_compression') if reference['config'].get('auto_codec') \
        else ()
    for rank, hello in sorted(hellos.items()):
        for name in sorted(set(reference['config']) | set(hello['config'])):
            if name in chosen and hello['config'].get('auto_codec'):
                continue
            mine, theirs = reference['config'].get(name), hello['config'].get(name)
            if name == 'optimizer':
                differences = optimizer_differences(mine, theirs, PER_STEP_FIELDS)
                if differences:
                    return optimizer_mismatch(differences, 'worker 0%s' % _launcher_rank(reference),
                                              'worker %d%s' % (rank, _launcher_rank(hello)))
            elif mine != theirs:
                return ('workers disagree on %s: worker 0%s has %r, worker %d%s has %r; start '
                        'every worker with the same settings'
                        % (name, _launcher_rank(reference), mine, rank, _launcher_rank(hello),
                           theirs))
    return None


def saved_optimizer_differences(path, saved, expected):
    """How the optimizer `saved` in the server checkpoint `path` (an Optimizer, or None:
    saved without one) differs from the workers' `expected` (a ``describe_optimizer`` dict;
    None: not checked): the hyper-parameters the load will change (the saved ones take
    effect, as in gluon.Trainer).

    Raises
    ------
    ValueError
        If the saved optimizer is of another type than `expected` (its state cannot drive
        that one).
    """
    if expected is None or not isinstance(saved, mx.optimizer.Optimizer):
        return []  # saved without the optimizer: the current one stays
    described = describe_optimizer(saved)
    if type_difference(expected, described):
        raise ValueError(
            '%s was saved with optimizer %s, but the trainer loading it uses %s: its state '
            '(e.g. momentum buffers) cannot drive %s. Create the trainer with the '
            'checkpoint\'s optimizer (%r) to resume from it, or start without loading it'
            % (path, described['type'], expected.get('type'), expected.get('type'),
               described['type'].lower()))
    return optimizer_differences(expected, described)


class Ballots(object):
    """The workers' votes on collective steps: ``vote`` and ``tally`` (docs/design.md §4.4)."""

    def __init__(self):
        self._ballots = {}             # ballot -> {rank: error or None}

    def vote(self, body):
        """Record one worker's outcome (``body``: rank, ballot, error or None, and optionally
        a ``value``: a small JSON value that the tally returns to every worker)."""
        field(body, 'ballot', int, minimum=1)
        field(body, 'error', str, optional=True)
        ballot, rank = body['ballot'], body['rank']   # the rank: checked by the server
        votes = self._ballots.setdefault(ballot, {})
        if rank in votes:
            # ps-lite does not say who sent a command: a second vote for one rank is
            # another process speaking for it, refused (the first vote stands).
            raise ValueError('worker rank %d has already voted on ballot %d' % (rank, ballot))
        votes[rank] = (body.get('error'), body.get('value'))
        for old in [b for b in self._ballots if b < ballot - 1]:
            del self._ballots[old]   # every worker has tallied those
        return {'ballot': ballot}

    def tally(self, body, num_workers):
        """Every failure of ballot ``body['ballot']`` by rank, and every value given
        (``values``, by rank, if any), once all `num_workers` voted."""
        field(body, 'ballot', int, minimum=1)
        votes = self._ballots.get(body['ballot'], {})
        if len(votes) != num_workers:
            raise ValueError('ballot %s has votes from workers %s only'
                             % (body['ballot'], sorted(votes)))
        # Every failure's message, as long as the reply has room (many workers failing alike
        # would not fit): the rest are counted. Every worker reads the same reply.
        room = commands.reply_capacity(commands.reply_len(num_workers)) // 2
        errors, more, values = {}, 0, {}
        for rank, (error, value) in sorted(votes.items()):
            if error and room > 0:
                errors[str(rank)] = error[:_MAX_ERROR]
                room -= len(errors[str(rank)].encode('utf-8')) + 32
            elif error:
                more += 1
            if value is not None:
                values[str(rank)] = value
        reply = {'errors': errors, 'more': more}
        if values:
            reply['values'] = values
        return reply
