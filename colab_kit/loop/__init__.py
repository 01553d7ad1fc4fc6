"""`CheckpointStore`: the kit's durability for plain PyTorch loops (`store`), which checkpoint it restores
(`storefind`), how every rank loads it (`storeload`), when it refuses (`storerules`), and its files
(`statefiles`)."""
