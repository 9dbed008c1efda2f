{{/* Environment every job gets: S3 endpoint and credentials, the Pushgateway, caches on /scratch (or the
     shared model cache), then the job's extraEnv. `.index` true: SAPD_METRICS_INSTANCE is the pod's
     completion index (a Pushgateway grouping key per worker). */}}
{{- define "sapd.env" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
- name: SAPD_S3_ENDPOINT_URL
  value: {{ .root.Values.s3.endpoint | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ .root.Values.s3.region | quote }}
{{- if not .root.Values.s3.useServiceAccount }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.secretAccessKeyKey }}
{{- end }}
- name: SAPD_PUSHGATEWAY_URL
  value: {{ .root.Values.pushgateway.url | quote }}
- name: SAPD_JOB
  value: {{ .component }}
# the training ranks (train pods × processes per pod): what the checks size ZeRO's shards by and divide a
# minibatch's micro-batches over, in the driver and the preflight pod too
- name: SAPD_TRAIN_PROCESSES
  value: {{ mul (int .root.Values.train.parallelism) (int .root.Values.train.procsPerPod) | quote }}
- name: SAPD_RELEASE
  value: {{ .root.Release.Name | quote }}
- name: SAPD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if .index }}
- name: SAPD_METRICS_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
{{- end }}
- name: HOME
  value: /scratch/home
{{- if .root.Values.modelCache.type }}
- name: SAPD_CACHE_DIR
  value: {{ printf "%s/sapd" .root.Values.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/hf" .root.Values.modelCache.mountPath | quote }}
{{- else }}
- name: HF_HOME
  value: /scratch/hf
{{- end }}
- name: SAPD_TEXTWORLD_CACHE
  value: {{ ternary (printf "%s/textworld" .root.Values.modelCache.mountPath) "/scratch/textworld" (ne .root.Values.modelCache.type "") | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if and .webshop .root.Values.evaluate.webshop.url }}
- name: SAPD_WEBSHOP_URL
  value: {{ .root.Values.evaluate.webshop.url | quote }}
{{- end }}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- /* values as strings: `--set extraEnv[0].value=1` gives a number, which a pod spec refuses */}}
{{- $extra := list }}
{{- range $s.extraEnv }}
{{- $e := deepCopy . }}
{{- if hasKey $e "value" }}{{ $_ := set $e "value" (toString $e.value) }}{{ end }}
{{- $extra = append $extra $e }}
{{- end }}
{{- with $extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}
