# Evaluates nix/module.nix with nixpkgs' own module system (lib.evalModules:
# real option types and their checks, mkIf/mkMerge, escapeShellArgs), with
# `overrides` (JSON) set on top of `enable = true`. The NixOS options the
# module sets but does not declare (systemd, users, nix.package) are
# declared loosely here, as NixOS would merge them. Prints what the module
# makes (nix-instantiate --eval --strict --json).
#
#   nix-instantiate --eval --strict --json tests/nix/eval-module-nixpkgs.nix \
#     --arg nixpkgsLib "$NIXPKGS_LIB" --argstr overrides '{}'
{ nixpkgsLib, overrides ? "{}" }:
let
  lib = import nixpkgsLib;
  inherit (lib) mkOption types;
  loose = mkOption { type = types.attrsOf types.anything; default = { }; };
  nixos = {
    options = {
      systemd.services = loose;
      systemd.timers = loose;
      users.users = loose;
      users.groups = loose;
      nix.package = mkOption { type = types.str; default = "/nix/store/nix"; };
    };
    config._module.args.pkgs = { openssh = "/nix/store/openssh"; };
  };
  evaluated = lib.evalModules {
    modules = [
      ../../nix/module.nix
      nixos
      {
        services.berth = {
          enable = true;
          # A package as types.package takes it (a derivation), without
          # building one: its store path is all the module uses.
          package = { type = "derivation"; name = "berth"; outPath = "/nix/store/berth"; };
        } // builtins.fromJSON overrides;
      }
    ];
  };
in
{
  inherit (evaluated.config) systemd users;
  # Every option of the module with its value: the test checks that each
  # reaches the unit.
  options = evaluated.config.services.berth;
}
