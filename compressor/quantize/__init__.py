"""unionsparse.compressor.quantize"""
