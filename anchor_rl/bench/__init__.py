"""anchor_rl.bench"""
