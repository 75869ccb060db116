"""Consumer groups: the classic coordinator and committed offsets, KIP-848 consumer groups and
their APIs, and the small admin client the operators' tools use."""
