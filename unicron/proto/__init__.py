"""Wire protocol of the unicron mesh: versioned, schema-checked, HMAC-signed JSON."""

from unicron.proto.messages import PROTOCOL_VERSION, Codec, Message

__all__ = ["PROTOCOL_VERSION", "Codec", "Message"]
