"""trl_ext"""
