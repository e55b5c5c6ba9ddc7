"""Worker/router <-> KV store messages (ZeroMQ DEALER/ROUTER, msgpack; see protocol/codec.py).

Every request and every reply carries `request_id`: the client picks it, the reply echoes it
(a late reply to a request that already timed out is recognised and dropped). Each verb has
one request and one reply type; a refused request is answered with an ErrorReply instead
(request_id 0 when the request could not even be decoded).

    base.py    the protocol, the bounds on fields, the bases, ErrorReply, decode_store_message,
               and the verbs both services answer: stats check lookup_prefix
    data.py    the data server: hello bye put get get_layers exists pin renew release evict
               prefetch node_info
    master.py  the master: join heartbeat leave update nodes place locate lease_group
               take_lease_group

Every message registers in one STORE_PROTOCOL. Importing any of these modules imports this
package first, which imports both message modules: every side decodes every verb (and refuses
the ones its socket does not serve with an ErrorReply, not a decode error).
"""

from pdserve.protocol.store import data, master  # noqa: F401  (registers their messages)
