# Evaluates nix/module.nix with the stub lib: every option at its default,
# then `overrides` (JSON, merged deeply), `enable = true`. Prints the
# module's `config` (nix-instantiate --eval --strict --json).
{ overrides ? "{}" }:
let
  lib = import ./stub-lib.nix;
  module = cfg: import ../../nix/module.nix {
    inherit lib;
    config = { services.berth = cfg; nix.package = "/nix/store/nix"; };
    pkgs = { openssh = "/nix/store/openssh"; };
  };
  defaults = options: builtins.mapAttrs
    (name: option: if (option._type or null) == "option" then option.default or null else defaults option)
    options;
  merge = base: extra: base // builtins.mapAttrs
    (name: value: if builtins.isAttrs value && builtins.isAttrs (base.${name} or null) then merge base.${name} value else value)
    extra;
  cfg = merge (defaults (module { }).options.services.berth)
    ({ enable = true; package = "/nix/store/berth"; } // builtins.fromJSON overrides);
in
(module cfg).config
