"""unionsparse.compressor"""
