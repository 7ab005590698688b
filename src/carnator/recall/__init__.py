"""What recall ranks the cache's requests by: :mod:`.embedder`, the text model mapping prompts to the unit vectors of
the cache's vector index (the recall stage itself: :mod:`carnator.stages.recall`)."""
