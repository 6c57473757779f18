"""unionsparse.compressor.calibrate"""
