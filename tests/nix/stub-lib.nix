# Just enough of nixpkgs' `lib` to evaluate nix/module.nix on a machine with
# Nix but no nixpkgs (tests/integration/nix.rs): an option is a record with
# its default, mkIf keeps or drops its content. Not the module system: no
# merging, no type checks; the test checks what the module writes.
rec {
  mkOption = attrs: attrs // { _type = "option"; };
  mkEnableOption = name: mkOption { type = types.bool; default = false; description = "Whether to enable ${name}."; };
  mkIf = cond: content: if cond then content else { };
  mkDefault = value: value;
  optional = cond: value: if cond then [ value ] else [ ];
  optionals = cond: values: if cond then values else [ ];
  optionalAttrs = cond: attrs: if cond then attrs else { };
  concatStringsSep = builtins.concatStringsSep;
  # nixpkgs quotes each argument for the shell; the test reads them back.
  escapeShellArgs = args: builtins.concatStringsSep " " (map (a: "'${a}'") args);
  types = let type = name: { inherit name; }; in {
    bool = type "bool";
    str = type "str";
    int = type "int";
    path = type "path";
    package = type "package";
    listOf = element: type "listOf";
    nullOr = element: type "nullOr";
  };
}
