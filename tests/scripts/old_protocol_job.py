"""Workers that speak protocol 3 (mxdelay before the finish counter's exchanged element, see
kvstore_ext.protocol.commands) to today's servers: the hand-shake must refuse them."""
import mxdelay  # noqa: F401  before mxnet, as every job script
import mxnet as mx

from kvstore_ext.protocol import commands


def main():
    commands.PROTOCOL_VERSION = 3   # what the worker's hello says (read when it is sent)
    kv = mx.kv.create('dist_delay')
    kv.init(0, mx.nd.ones(3))
    print('initialised')


if __name__ == '__main__':
    main()
