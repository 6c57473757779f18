"""unionsparse.compressor.report"""
