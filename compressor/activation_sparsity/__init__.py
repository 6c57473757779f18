"""unionsparse.compressor.activation_sparsity"""
