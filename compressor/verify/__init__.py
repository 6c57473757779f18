"""unionsparse.compressor.verify"""
