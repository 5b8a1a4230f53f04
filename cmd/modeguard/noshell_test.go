package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// shells are programs that would read their arguments as shell code.
var shells = map[string]bool{"sh": true, "bash": true, "dash": true, "zsh": true, "ksh": true, "ash": true, "busybox": true}

func isShell(s string) bool { return shells[path.Base(s)] }

// execFuncs start a program with an argument vector.
var execFuncs = map[string]bool{
	"os/exec.Command": true, "os/exec.CommandContext": true, "os.StartProcess": true,
	"syscall.Exec": true, "syscall.ForkExec": true, "golang.org/x/sys/unix.Exec": true,
}

// shellUses parses every non-test Go file under roots and reports each call
// of execFuncs whose arguments name a shell or pass "-c", and each string
// constant anywhere that names a shell (a helper such as run(ctx, "sh", ...)
// hides the shell from the first check). It also counts the files and the
// calls it saw.
func shellUses(roots ...string) (found []string, files, calls int, err error) {
	fset := token.NewFileSet()
	for _, root := range roots {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return nil
			}
			f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			files++
			imported := map[string]string{} // local name -> import path
			for _, imp := range f.Imports {
				ip, _ := strconv.Unquote(imp.Path.Value)
				name := path.Base(ip)
				if imp.Name != nil {
					name = imp.Name.Name
				}
				imported[name] = ip
			}
			ast.Inspect(f, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.BasicLit:
					if s, err := strconv.Unquote(n.Value); err == nil && n.Kind == token.STRING && isShell(s) {
						found = append(found, fmt.Sprintf("%s: the string %q names a shell", fset.Position(n.Pos()), s))
					}
				case *ast.CallExpr:
					sel, ok := n.Fun.(*ast.SelectorExpr)
					if !ok {
						return true
					}
					pkg, ok := sel.X.(*ast.Ident)
					if !ok || !execFuncs[imported[pkg.Name]+"."+sel.Sel.Name] {
						return true
					}
					calls++
					for _, arg := range n.Args {
						ast.Inspect(arg, func(m ast.Node) bool {
							lit, ok := m.(*ast.BasicLit)
							if !ok || lit.Kind != token.STRING {
								return true
							}
							if s, _ := strconv.Unquote(lit.Value); s == "-c" || isShell(s) {
								found = append(found, fmt.Sprintf("%s: %s.%s passes %q", fset.Position(lit.Pos()), pkg.Name, sel.Sel.Name, s))
							}
							return true
						})
					}
				}
				return true
			})
			return nil
		})
		if err != nil {
			return found, files, calls, err
		}
	}
	return found, files, calls, nil
}

// TestNoShell fails when the driver's sources (cmd/ and pkg/, tests left
// out) could run a shell. Every argument the driver passes to a command is
// then one argv element, so no volume id, path or mount flag from a CO can
// become a command.
func TestNoShell(t *testing.T) {
	found, files, calls, err := shellUses("../../cmd", "../../pkg")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		t.Errorf("%s: commands must run without a shell", f)
	}
	// The driver runs losetup, mkfs, cp, xfs_quota, ganesha and dbus-daemon;
	// finding no call at all would mean the scan looked nowhere.
	if files < 20 || calls < 5 {
		t.Fatalf("scanned %d files and %d command calls; the scan did not find the sources", files, calls)
	}
	t.Logf("scanned %d files, %d command calls", files, calls)

	// The scan itself finds each way of running a shell.
	dir := t.TempDir()
	bad := `package bad

import (
	"context"
	x "os/exec"
)

func run(ctx context.Context, name string, args ...string) error {
	return x.CommandContext(ctx, name, args...).Run()
}

func a() error { return x.Command("/bin/sh", "-c", "losetup -a").Run() }
func b() error { return run(context.Background(), "bash", "script") }
func c() error { return x.Command("env", append([]string{"-c"}, "x")...).Run() }
`
	if err := os.WriteFile(filepath.Join(dir, "bad.go"), []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	found, _, calls, err = shellUses(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 5 || calls != 3 {
		t.Errorf("in a planted file the scan found %d calls and %d uses, want 3 and 5:\n%s", calls, len(found), strings.Join(found, "\n"))
	}
}
