"""``mxdelay-launch``'s output: every child's lines, prefixed with its role and rank.

Stdout lines go to stdout, stderr lines to stderr, whole lines only (``[worker 1] ``,
``[server 0] ``, ``[scheduler] ``).
"""
import os
import selectors
import time

__all__ = ['Output']


class Output:
    """Copy the children's pipes to our stdout and stderr, one prefixed line at a time."""

    def __init__(self):
        self._selector = selectors.DefaultSelector()
        self._partial = {}

    def add(self, pipe, prefix, sink):
        """Copy `pipe` to `sink` (a binary stream), each line prefixed with `prefix`."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe, selectors.EVENT_READ, (prefix, sink))
        self._partial[pipe] = b''

    def pump(self, seconds, until_closed=()):
        """Copy output for `seconds`, or less once every pipe of `until_closed` has closed."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (until_closed and
                                  not any(pipe in self._partial for pipe in until_closed)):
                return
            for key, _ in self._selector.select(remaining):
                self._read(key.fileobj, *key.data)

    def _read(self, pipe, prefix, sink):
        chunk = os.read(pipe.fileno(), 65536)
        data = self._partial[pipe] + chunk
        if not chunk:  # end of file: the last line may lack its newline
            self._selector.unregister(pipe)
            del self._partial[pipe]
            pipe.close()
            lines, rest = data, b''
            if lines and not lines.endswith(b'\n'):
                lines += b'\n'
        else:
            cut = data.rfind(b'\n') + 1
            lines, rest = data[:cut], data[cut:]
            self._partial[pipe] = rest
        if lines:
            sink.write(b''.join(prefix + line + b'\n' for line in lines[:-1].split(b'\n')))
            sink.flush()
