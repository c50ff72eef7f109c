"""anchor_rl.models"""
