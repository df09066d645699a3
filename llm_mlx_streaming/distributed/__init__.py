"""A pipeline of streamed ranks: each machine holds a range of layers, its own dense
weights and its own expert pools, and rank 0 drives the others with mlx.distributed."""
