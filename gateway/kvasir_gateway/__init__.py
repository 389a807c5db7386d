"""kvasir-gateway: an OpenAI-compatible proxy that counts in tokens (docs/gateway.md)."""
