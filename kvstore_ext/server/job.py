"""What one server knows of its job, shared by its parts, and how it answers the workers.

ps-lite tells a server its rank and the number of workers only once the server runs (asking
before crashes), so :class:`Job` starts empty and the controller fills it on its first call.
A reply goes into the requesting worker's segment of the server's status key, which the
workers then pull (docs/design.md §4.2).
"""
from kvstore_ext.protocol import commands

__all__ = ['ALLOW_PICKLE', 'Job']

#: The env variable that lets a server unpickle what a command brings (kvstore_ext.env): a
#: stock worker's optimizer, a version-1 checkpoint.
ALLOW_PICKLE = 'MXDELAY_ALLOW_PICKLE'


class Job(object):
    """One server's place in its job.

    Attributes
    ----------
    server_rank, num_workers : int or None
        This server's rank and the job's number of workers (None until the server runs).
    rescale_grad : float or None
        The job's ``rescale_grad``: worker 0's at the hand-shake, or a loaded checkpoint's;
        every optimizer this server installs gets it.
    status : mxnet.nd.NDArray or None
        This server's status key, from the hand-shake round: the replies are written there.
    """

    def __init__(self):
        self.server_rank = None
        self.num_workers = None
        self.rescale_grad = None
        self.status = None

    def reply(self, rank, ok, payload, seq=0):
        """Write the reply `payload` (`ok`: not a refusal) to command `seq` into worker
        `rank`'s segment of the status key."""
        length = commands.reply_len(self.num_workers)
        segment = self.status[rank * length:(rank + 1) * length]
        segment[:] = commands.encode_reply(ok, payload, seq, length)
        # The worker pulls right after the command returns; the native pull copies the
        # stored bytes without waiting on the engine.
        segment.wait_to_read()

    def reply_all(self, ok, payload):
        """Write the same reply into every worker's segment (the hand-shake's)."""
        for rank in range(self.num_workers):
            self.reply(rank, ok, payload)
