"""unionsparse.compressor.artifact"""
